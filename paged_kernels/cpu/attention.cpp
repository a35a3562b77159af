// Paged attention on CPU for every row of a step (decodes, drafts to verify, prefill chunks of any length), K/V read
// in place from the block pool (no gather into a padded tensor). Plain C ABI, called through ctypes
// (paged_kernels/cpu_attention.py); OpenMP is the runtime torch already loaded (same soname), so its threads are the
// forward's.
//
// **One token's result does not depend on its row.** A query token at position t computes the same operations in the
// same order whatever else is in the step, however its row was chunked (a prompt in one chunk, the tail after a
// prefix-cache hit, a decoded token recomputed inside a chunk after a preemption), and whichever thread runs it:
// - a score is ``dot``: 16 lanes, lane l the fmaf chain over d = l, l + 16, ..., then the lanes summed pairwise in a
//   fixed order; times the scale;
// - the softmax's max is exact in any order; exp is elementwise;
// - its sum runs in 16 lanes over positions (lane j takes positions j, j + 16, ...; positions past the token's own
//   are 0, and x + 0 == x), then lanes 0..15 in order;
// - the output is one fmaf chain over the positions it sees, in order, per element, times 1 / sum.
// Nothing is reassociated: the flags carry -ffp-contract=off (no mul+add fused behind our back) and no -ffast-math,
// and every multiply-add meant to be fused is an explicit fmaf, so a vectorised loop and its scalar tail agree bit
// for bit.
//
// Work items are (row, tile of up to QT of its tokens): the tile's tokens and every query head share each position's
// K and V rows (all KV heads, contiguous), read once per item; with fewer tiles than threads, (tile, KV head).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t KT = 16;  // lanes of the softmax's sum
constexpr int64_t QT = 8;   // query tokens per work item

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
  std::vector<float> scores;  // [QT * G][P]: the item's scores, then weights
  std::vector<float> acc;     // [QT * G][D]
  std::vector<float> inv;     // [QT * G]: 1 / each pair's sum
};

// q . k over D: lane l (of 16) is the fmaf chain over d = l, l + 16, ...; then the lanes pairwise, halving, in a fixed
// order. One function for every score, so a score's bits never depend on which loop computed it.
inline float dot(const float* q, const float* k, int64_t D) {
  float lane[16] = {};
  if (D % 16 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
#pragma omp simd
      for (int64_t l = 0; l < 16; ++l) lane[l] = std::fmaf(q[d0 + l], k[d0 + l], lane[l]);
    }
  } else {
    for (int64_t d = 0; d < D; ++d) lane[d % 16] = std::fmaf(q[d], k[d], lane[d % 16]);
  }
  for (int64_t half = 8; half >= 1; half /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < half; ++l) lane[l] = lane[l] + lane[l + half];
  }
  return lane[0];
}

inline const float* row_at(const float* cache, const int32_t* table, int64_t p, int64_t g, const Shape& s) {
  return cache + ((int64_t(table[p / s.BS]) * s.BS + p % s.BS) * s.KVH + g) * s.D;
}

// The item: row tokens [i0, i1) of a row with L positions of context (its new tokens included, first = L - n), query
// heads [h0, h0 + nh) (whole KV groups); q/out point at the row's first token.
void item(const float* q, const float* k_cache, const float* v_cache, const int32_t* table, int64_t L, int64_t n,
          int64_t i0, int64_t i1, int64_t h0, int64_t nh, const Shape& s, float* out, Scratch& w) {
  const int64_t G = s.H / s.KVH, D = s.D, first = L - n;
  const int64_t P = first + i1;  // positions the tile's last token sees
  const int64_t span = (P + KT - 1) / KT * KT;
  const int64_t pairs = (i1 - i0) * nh;  // (token, query head) pairs: pair r = (i0 + r / nh, h0 + r % nh)
  w.scores.resize(pairs * span);
  w.acc.assign(pairs * D, 0.0f);
  w.inv.resize(pairs);
  // Scores: each position's K row (this KV head's) read once, for every token of the tile that sees it and every
  // query head of the group.
  for (int64_t p = 0; p < P; ++p) {
    const float* k = row_at(k_cache, table, p, 0, s);  // every KV head's, contiguous
    for (int64_t r = (p > first + i0 ? p - first - i0 : 0) * nh; r < pairs; ++r) {
      const int64_t h = h0 + r % nh;
      const float* qr = q + ((i0 + r / nh) * s.H + h) * D;
      w.scores[r * span + p] = dot(qr, k + (h / G) * D, D) * s.scale;
    }
  }
  // Softmax per pair: weights exp(score - max) over the positions the token sees, 0 past them.
  for (int64_t r = 0; r < pairs; ++r) {
    float* sc = w.scores.data() + r * span;
    const int64_t seen = first + i0 + r / nh + 1;
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
    const float* v = row_at(v_cache, table, p, 0, s);
    for (int64_t r = (p > first + i0 ? p - first - i0 : 0) * nh; r < pairs; ++r) {
      const float wt = w.scores[r * span + p];
      const float* vh = v + ((h0 + r % nh) / G) * D;
      float* a = w.acc.data() + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] = std::fmaf(wt, vh[d], a[d]);
    }
  }
  for (int64_t r = 0; r < pairs; ++r) {
    float* o = out + ((i0 + r / nh) * s.H + h0 + r % nh) * D;
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
  // Items, row-major: (row, tile of its tokens), then the KV head. Fewer rows than threads (one row of drafts to
  // verify): tiles of fewer tokens, so that each thread has some (a tile's size never changes a token's result).
  int64_t qt = QT;
  if (S < threads) {
    int64_t longest = 1;
    for (int64_t s = 0; s < S; ++s) longest = std::max<int64_t>(longest, starts[s + 1] - starts[s]);
    qt = std::min<int64_t>(QT, (longest + threads - 1) / threads);
  }
  std::vector<int64_t> tile_row, tile_start;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = 0; i < starts[s + 1] - starts[s]; i += qt) {
      tile_row.push_back(s);
      tile_start.push_back(i);
    }
  }
  // Fewer tiles than threads: each tile's KV heads are items of their own, so that every thread has work.
  const int64_t split = int64_t(tile_row.size()) >= threads ? 1 : KVH, nh = H / split;
  const int64_t items = int64_t(tile_row.size()) * split;
#pragma omp parallel num_threads(threads)
  {
    Scratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t tile = it / split, h0 = (it % split) * nh, s = tile_row[tile];
      const int64_t t0 = starts[s], n = starts[s + 1] - t0, i0 = tile_start[tile];
      const int64_t i1 = i0 + qt < n ? i0 + qt : n;
      item(q + t0 * H * D, k_cache, v_cache, tables + s * MB, lens[s], n, i0, i1, h0, nh, shape, out + t0 * H * D, w);
    }
  }
}

// Rotary embedding of a step's q and k, and k and v written into their cache slots, in one call (the lean forward's
// ``rope`` then ``reshape_and_cache``: ~19 torch ops a layer). Element for element the same arithmetic as
// ``x * cos + roll(x, D / 2) * sin_signed`` in torch, two products rounded, then their sum (-ffp-contract=off: no
// fused multiply-add), so the bits are torch's. q is rotated in place; a slot < 0 is skipped. One thread: a decode
// step's rows are a few KB, and a parallel region would be one more barrier a step.
extern "C" void rope_and_cache_f32(
    float* q,                 // [T, H, D], row stride q_stride
    const float* k,           // [T, KVH, D], row stride k_stride
    const float* v,           // [T, KVH, D], row stride v_stride
    const float* cos,         // [T, D]
    const float* sin_signed,  // [T, D]: sin with its first half negated
    float* k_cache,           // [num_blocks * BS, KVH, D]
    float* v_cache,
    const int64_t* slots,  // [T]
    int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t q_stride, int64_t k_stride, int64_t v_stride) {
  std::vector<float> row(D);
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + t * D;
    const float* s = sin_signed + t * D;
    for (int64_t h = 0; h < H; ++h) {
      float* x = q + t * q_stride + h * D;
      for (int64_t d = 0; d < D; ++d) {
        const float a = x[d] * c[d];
        const float b = x[d < half ? d + half : d - half] * s[d];
        row[d] = a + b;
      }
      std::memcpy(x, row.data(), sizeof(float) * D);
    }
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < KVH; ++h) {
      const float* x = k + t * k_stride + h * D;
      float* kc = k_cache + (slot * KVH + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float a = x[d] * c[d];
        const float b = x[d < half ? d + half : d - half] * s[d];
        kc[d] = a + b;
      }
      std::memcpy(v_cache + (slot * KVH + h) * D, v + t * v_stride + h * D, sizeof(float) * D);
    }
  }
}
