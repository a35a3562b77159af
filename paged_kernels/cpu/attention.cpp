// Paged attention on CPU for every row of a step (decodes, drafts to verify, prefill chunks of any length), K/V read
// in place from the block pool (no gather into a padded tensor). Plain C ABI, called through ctypes
// (paged_kernels/cpu_attention.py); OpenMP is the runtime torch already loaded (same soname), so its threads are the
// forward's.
//
// **One token's result does not depend on its row.** A query token at position t computes the same operations in the
// same order whatever else is in the step, however its row was chunked (a prompt in one chunk, the tail after a
// prefix-cache hit, a decoded token recomputed inside a chunk after a preemption), and whichever thread runs it:
// - a score is one fmaf chain over d = 0..D-1, then times the scale;
// - the softmax's max is exact in any order; exp is elementwise;
// - its sum runs in 16 lanes over positions (lane j takes positions j, j + 16, ...; positions past the token's own
//   are 0, and x + 0 == x), then lanes 0..15 in order;
// - the output is one fmaf chain over positions per element (weight 0 past the token's position: fmaf(0, v, a) == a
//   for finite v, and every position a row's tokens can see was written before this call), times 1 / sum.
// Nothing is reassociated: the flags carry -ffp-contract=off (no mul+add fused behind our back) and no -ffast-math,
// and every multiply-add meant to be fused is an explicit fmaf, so a vectorised loop and its scalar tail agree bit
// for bit.
//
// Work items are (row, tile of up to QT of its tokens, KV head): the tile's tokens and the KV head's query heads share
// each 16-position key tile (transposed once) and each V row.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t KT = 16;  // key positions per tile (and lanes of the sums)
constexpr int64_t QT = 8;   // query tokens per work item
constexpr int64_t UNROLL = 4;  // score chains run side by side

// exp(x) for x <= 0 (scores minus their max), vectorisable: x = n ln2 + r (Cody-Waite), exp(r) by Cephes' expf
// polynomial (within 2 ulp of exp), times 2^n built in the exponent bits (the loop vectorises with
// -fno-trapping-math; libm's expf does not). Below -87 it gives exp(-87) (~1.6e-38, nothing beside the max's 1).
inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;
  const int32_t n = int32_t(x * 1.44269504088896341f - 0.5f);  // round to nearest (x <= 0)
  float r = x - float(n) * 0.693359375f;
  r = r + float(n) * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  return y * __builtin_bit_cast(float, (n + 127) << 23);
}

struct Shape {
  int64_t H, KVH, D, BS, MB;
  float scale;
};

struct Scratch {
  std::vector<float> kt;      // [D][KT]: one key tile, transposed
  std::vector<float> scores;  // [QT * G][P]: the item's scores, then weights
  std::vector<float> acc;     // [QT * G][D]
  std::vector<float> inv;     // [QT * G]: 1 / each pair's sum
};

// The item: row tokens [i0, i1) of a row with L positions of context (its new tokens included, first = L - n), KV
// head g; q/out point at the row's first token.
void item(const float* q, const float* k_cache, const float* v_cache, const int32_t* table, int64_t L, int64_t n,
          int64_t i0, int64_t i1, int64_t g, const Shape& s, float* out, Scratch& w) {
  const int64_t G = s.H / s.KVH, D = s.D, first = L - n;
  const int64_t P = first + i1;  // positions the tile's last token sees
  const int64_t tiles = (P + KT - 1) / KT, span = tiles * KT;
  const int64_t pairs = (i1 - i0) * G;  // (token, query head) pairs: pair r = (i0 + r / G, g * G + r % G)
  w.kt.resize(D * KT);
  w.scores.resize(pairs * span);
  w.acc.assign(pairs * D, 0.0f);
  w.inv.resize(pairs);
  float* kt = w.kt.data();
  // Scores: per key tile, K transposed to [D][KT], then one fmaf chain over d per (pair, position).
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t p0 = t * KT;
    for (int64_t j = 0; j < KT; ++j) {
      const int64_t p = p0 + j;
      if (p < P) {
        const float* krow = k_cache + ((int64_t(table[p / s.BS]) * s.BS + p % s.BS) * s.KVH + g) * D;
        for (int64_t d = 0; d < D; ++d) kt[d * KT + j] = krow[d];
      } else {
        for (int64_t d = 0; d < D; ++d) kt[d * KT + j] = 0.0f;
      }
    }
    // UNROLL pairs at a time: independent fmaf chains, so the FMA unit is not waiting on one chain's latency.
    for (int64_t r0 = 0; r0 < pairs; r0 += UNROLL) {
      const int64_t u_n = pairs - r0 < UNROLL ? pairs - r0 : UNROLL;
      const float* qr[UNROLL];
      for (int64_t u = 0; u < UNROLL; ++u) {
        const int64_t r = r0 + (u < u_n ? u : 0);
        qr[u] = q + ((i0 + r / G) * s.H + g * G + r % G) * D;
      }
      float a[UNROLL][KT] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * KT;
        for (int64_t u = 0; u < UNROLL; ++u) {
          const float x = qr[u][d];
#pragma omp simd
          for (int64_t j = 0; j < KT; ++j) a[u][j] = std::fmaf(x, kd[j], a[u][j]);
        }
      }
      for (int64_t u = 0; u < u_n; ++u) {
        float* sc = w.scores.data() + (r0 + u) * span + p0;
#pragma omp simd
        for (int64_t j = 0; j < KT; ++j) sc[j] = a[u][j] * s.scale;
      }
    }
  }
  // Softmax per pair: weights exp(score - max) over the positions the token sees, 0 past them.
  for (int64_t r = 0; r < pairs; ++r) {
    float* sc = w.scores.data() + r * span;
    const int64_t seen = first + i0 + r / G + 1;
    float m = sc[0];
    for (int64_t p = 1; p < seen; ++p) m = sc[p] > m ? sc[p] : m;
#pragma omp simd
    for (int64_t p = 0; p < seen; ++p) sc[p] = exp_nonpositive(sc[p] - m);
    for (int64_t p = seen; p < span; ++p) sc[p] = 0.0f;
    float lane[KT] = {};
    for (int64_t p0 = 0; p0 < span; p0 += KT) {
#pragma omp simd
      for (int64_t j = 0; j < KT; ++j) lane[j] = lane[j] + sc[p0 + j];
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < KT; ++j) sum = sum + lane[j];
    w.inv[r] = 1.0f / sum;
  }
  // Weighted sum of V: one fmaf chain over positions per output element.
  for (int64_t p = 0; p < P; ++p) {
    const float* v = v_cache + ((int64_t(table[p / s.BS]) * s.BS + p % s.BS) * s.KVH + g) * D;
    for (int64_t r = 0; r < pairs; ++r) {
      const float wt = w.scores[r * span + p];
      float* a = w.acc.data() + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] = std::fmaf(wt, v[d], a[d]);
    }
  }
  for (int64_t r = 0; r < pairs; ++r) {
    float* o = out + ((i0 + r / G) * s.H + g * G + r % G) * D;
    const float* a = w.acc.data() + r * D;
    const float inv = w.inv[r];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
  }
}

}  // namespace

extern "C" void paged_attention_f32(
    const float* q,          // [T, H, D]: the rows' new tokens, row after row
    const float* k_cache,    // [num_blocks, BS, KVH, D]
    const float* v_cache,    // [num_blocks, BS, KVH, D]
    const int32_t* tables,   // [S, MB] physical block of each logical block
    const int32_t* lens,     // [S] context length, the new tokens included
    const int32_t* starts,   // [S + 1] each row's first token in q
    float* out,              // [T, H, D]
    int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale, int32_t threads) {
  const Shape shape{H, KVH, D, BS, MB, scale};
  // Items, row-major: (row, tile of its tokens), then the KV head.
  std::vector<int64_t> tile_row, tile_start;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = 0; i < starts[s + 1] - starts[s]; i += QT) {
      tile_row.push_back(s);
      tile_start.push_back(i);
    }
  }
  const int64_t items = int64_t(tile_row.size()) * KVH;
#pragma omp parallel num_threads(threads)
  {
    Scratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t tile = it / KVH, g = it % KVH, s = tile_row[tile];
      const int64_t t0 = starts[s], n = starts[s + 1] - t0, i0 = tile_start[tile];
      const int64_t i1 = i0 + QT < n ? i0 + QT : n;
      item(q + t0 * H * D, k_cache, v_cache, tables + s * MB, lens[s], n, i0, i1, g, shape, out + t0 * H * D, w);
    }
  }
}
