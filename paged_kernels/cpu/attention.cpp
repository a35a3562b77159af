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
// - the output, per element: each block's share is one fmaf chain over the block's positions the token sees, in
//   order, from 0; the shares are added in block order, from 0; times 1 / sum. (Blocks, not the whole context,
//   so that rows can be read block by block in the pool's order; a block is a position's place in the table, not
//   where it lies in the pool, so where a row's blocks lie changes no bit either.)
// Nothing is reassociated: the flags carry -ffp-contract=off (no mul+add fused behind our back) and no -ffast-math,
// and every multiply-add meant to be fused is an explicit fmaf, so a vectorised loop and its scalar tail agree bit
// for bit.
//
// Rows of up to SWEEP new tokens (decodes, drafts to verify) go through ``sweep``: every block the step's short rows
// read, once, in the pool's order. Longer rows (prefill chunks) are work items (row, tile of up to QT of its tokens):
// the tile's tokens and every query head share each position's K and V rows (all KV heads, contiguous), read once
// per item; with fewer tiles than threads, (tile, KV head).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t KT = 16;  // lanes of the softmax's sum
constexpr int64_t QT = 16;  // query tokens per work item
constexpr int64_t SWEEP = 16;  // rows of up to this many new tokens go through ``sweep``

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
  std::vector<float> kt;      // [groups][D][16]: 16 positions' K rows, transposed (``dot16``)
  std::vector<float> scores;  // [QT * G][P]: the item's scores, then weights
  std::vector<float> acc;     // [QT * G][D]
  std::vector<float> inv;     // [QT * G]: 1 / each pair's sum
  std::vector<float> part;    // [QT * G][D]: one block's share of acc
};

inline void add(float* acc, const float* part, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + part[d];
}

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

// ``dot`` of one query row against 16 keys at once, the same arithmetic for each: ``kt`` [D][16] holds the keys' rows
// transposed, so lane l of key j is the same fmaf chain over d = l, l + 16, ..., kept in vector j of 16, and the lanes
// are added pairwise in ``dot``'s order with vector adds (no horizontal sums). D a multiple of 16.
inline void dot16(const float* q, const float* kt, int64_t D, float scale, float* out) {
  float lane[16][16] = {};
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    for (int64_t l = 0; l < 16; ++l) {
      const float qv = q[d0 + l];
      const float* kr = kt + (d0 + l) * 16;
#pragma omp simd
      for (int64_t j = 0; j < 16; ++j) lane[l][j] = std::fmaf(qv, kr[j], lane[l][j]);
    }
  }
  for (int64_t half = 8; half >= 1; half /= 2) {
    for (int64_t l = 0; l < half; ++l) {
#pragma omp simd
      for (int64_t j = 0; j < 16; ++j) lane[l][j] = lane[l][j] + lane[l + half][j];
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < 16; ++j) out[j] = lane[0][j] * scale;
}

// A block's share of a pair's output: per element, the fmaf chain over the block's first ``n`` positions in order, from
// 0 (``v`` the first position's V row for the pair's KV head, rows ``stride`` apart). The sweep's shares are the
// same chains. Sizes of D known here keep the chain in registers.
template <int64_t DD>
inline void share_fixed(const float* wt, const float* v, int64_t n, int64_t stride, float* part) {
  float a[DD] = {};
  for (int64_t p = 0; p < n; ++p) {
    const float x = wt[p];
    const float* vr = v + p * stride;
#pragma omp simd
    for (int64_t d = 0; d < DD; ++d) a[d] = std::fmaf(x, vr[d], a[d]);
  }
#pragma omp simd
  for (int64_t d = 0; d < DD; ++d) part[d] = a[d];
}

inline void block_share(const float* wt, const float* v, int64_t n, int64_t stride, int64_t D, float* part) {
  if (D == 64) return share_fixed<64>(wt, v, n, stride, part);
  if (D == 128) return share_fixed<128>(wt, v, n, stride, part);
  std::fill(part, part + D, 0.0f);
  for (int64_t p = 0; p < n; ++p) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) part[d] = std::fmaf(wt[p], v[p * stride + d], part[d]);
  }
}

inline const float* row_at(const float* cache, const int32_t* table, int64_t p, int64_t g, const Shape& s) {
  return cache + ((int64_t(table[p / s.BS]) * s.BS + p % s.BS) * s.KVH + g) * s.D;
}

// Softmax of a pair's scores: weights exp(score - max) over the ``seen`` positions its token sees, 0 past them up to
// ``span`` (a multiple of KT); returns 1 / the weights' sum.
inline float softmax(float* sc, int64_t seen, int64_t span) {
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
  return 1.0f / sum;
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
  // query head of the group. 16 positions at a time through ``dot16`` (a pair also gets the scores of the chunk's
  // positions past its own token: ``softmax`` overwrites those), the rest one by one through ``dot``.
  int64_t p = 0;
  if (D % 16 == 0) {
    const int64_t g0 = h0 / G, ng = nh / G;
    w.kt.resize(ng * D * 16);
    for (; p + 16 <= P; p += 16) {
      for (int64_t j = 0; j < 16; ++j) {
        const float* k = row_at(k_cache, table, p + j, 0, s);
        for (int64_t gi = 0; gi < ng; ++gi) {
          const float* kg = k + (g0 + gi) * D;
          float* t = w.kt.data() + gi * D * 16 + j;
          for (int64_t d = 0; d < D; ++d) t[d * 16] = kg[d];
        }
      }
      for (int64_t r = (p > first + i0 ? p - first - i0 : 0) * nh; r < pairs; ++r) {
        const int64_t h = h0 + r % nh;
        const float* qr = q + ((i0 + r / nh) * s.H + h) * D;
        dot16(qr, w.kt.data() + (h / G - g0) * D * 16, D, s.scale, w.scores.data() + r * span + p);
      }
    }
  }
  for (; p < P; ++p) {
    const float* k = row_at(k_cache, table, p, 0, s);  // every KV head's, contiguous
    for (int64_t r = (p > first + i0 ? p - first - i0 : 0) * nh; r < pairs; ++r) {
      const int64_t h = h0 + r % nh;
      const float* qr = q + ((i0 + r / nh) * s.H + h) * D;
      w.scores[r * span + p] = dot(qr, k + (h / G) * D, D) * s.scale;
    }
  }
  for (int64_t r = 0; r < pairs; ++r) w.inv[r] = softmax(w.scores.data() + r * span, first + i0 + r / nh + 1, span);
  // Weighted sum of V, block by block: each block's own fmaf chain over its positions (``block_share``), added to the
  // pair's sum in block order; pair after pair, so that a pair's sums stay in registers over the block (the block's V
  // rows stay in L1).
  w.part.resize(D);
  for (int64_t b0 = 0; b0 < P; b0 += s.BS) {
    const int64_t r0 = (b0 > first + i0 ? b0 - first - i0 : 0) * nh;  // the pairs whose token sees the block
    const int64_t pe = std::min(P, b0 + s.BS);
    const float* vb = v_cache + int64_t(table[b0 / s.BS]) * s.BS * s.KVH * D;
    for (int64_t r = r0; r < pairs; ++r) {
      const int64_t seen = std::min(pe, first + i0 + r / nh + 1);  // past the block's positions this token sees
      const float* vh = vb + ((h0 + r % nh) / G) * D;
      block_share(w.scores.data() + r * span + b0, vh, seen - b0, s.KVH * D, D, w.part.data());
      add(w.acc.data() + r * D, w.part.data(), D);
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

// A short row's use of one of its blocks: the row (its index among the step's short rows), the block's place in its
// table, the block, and where its share of the row's output sums is kept.
struct Use {
  int32_t block, row, j;
  int64_t part;
};

struct Short {
  const float* q;
  float* out;
  int64_t L, n, scores, span, uses;  // context length, new tokens, offset of its scores, their stride, first use
};

// Rows of a few new tokens (decodes, drafts to verify) over every block they read, in the pool's order: a full pool
// read block after block in place of one row's blocks after another's (each a short run somewhere in the pool, which
// memory serves at a third of its bandwidth on this class of machine; docs/benchmarks.md). The arithmetic is
// ``item``'s, so a token's bits do not depend on which path it took: the same ``dot`` for each score and
// ``softmax`` for each pair; each block's share of the output the same fmaf chain over its positions; the shares
// added in block order.
// ``n_scores`` / ``n_parts``: the floats the rows' scores and the uses' shares take (their offsets' ends).
void sweep(const std::vector<Short>& rows, const std::vector<Use>& uses, int64_t n_scores, int64_t n_parts,
           const float* k_cache, const float* v_cache, const Shape& s, int32_t threads) {
  const int64_t H = s.H, G = s.H / s.KVH, D = s.D, BS = s.BS, stride = s.KVH * s.D;
  static thread_local std::vector<float> scores, inv, parts;
  static thread_local std::vector<int64_t> at;  // rows[r].uses + j: the use of the row's block j
  static thread_local std::vector<int64_t> pair_row;  // first pair of each row, then the total
  int64_t n_pairs = 0;
  pair_row.assign(1, 0);
  for (const Short& r : rows) {
    n_pairs += r.n * H;
    pair_row.push_back(n_pairs);
  }
  if (int64_t(scores.size()) < n_scores) scores.resize(n_scores);
  if (int64_t(parts.size()) < n_parts) parts.resize(n_parts);
  inv.resize(n_pairs);
  at.resize(uses.size());
  for (int64_t k = 0; k < int64_t(uses.size()); ++k) at[rows[uses[k].row].uses + uses[k].j] = k;
  // thread_local: the buffers are the calling thread's; the team reaches them through these pointers.
  float* const sc = scores.data();
  float* const iv = inv.data();
  float* const pa = parts.data();
  const int64_t* const pair0 = pair_row.data();
  const int64_t* const use_at = at.data();
  const int64_t n_uses = int64_t(uses.size()), R = int64_t(rows.size());
#pragma omp parallel num_threads(threads)
  {
    // Scores: each block's K rows once, for every token of its row that sees them and every query head.
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n_uses; ++k) {
      const Use& u = uses[k];
      const Short& r = rows[u.row];
      const int64_t first = r.L - r.n, p0 = int64_t(u.j) * BS, p1 = std::min(r.L, p0 + BS);
      const float* kb = k_cache + int64_t(u.block) * BS * stride;
      for (int64_t p = p0; p < p1; ++p) {
        const float* kr = kb + (p - p0) * stride;
        for (int64_t i = p > first ? p - first : 0; i < r.n; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            sc[r.scores + (i * H + h) * r.span + p] = dot(r.q + (i * H + h) * D, kr + (h / G) * D, D) * s.scale;
          }
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t x = 0; x < n_pairs; ++x) {
      const int64_t ri = std::upper_bound(pair0, pair0 + R + 1, x) - pair0 - 1;
      const Short& r = rows[ri];
      const int64_t pr = x - pair0[ri];  // (token, head) = (pr / H, pr % H)
      iv[x] = softmax(sc + r.scores + pr * r.span, r.L - r.n + pr / H + 1, r.span);
    }
    // Each block's share of the output: its V rows once.
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n_uses; ++k) {
      const Use& u = uses[k];
      const Short& r = rows[u.row];
      const int64_t first = r.L - r.n, p0 = int64_t(u.j) * BS, p1 = std::min(r.L, p0 + BS);
      const int64_t i0 = p0 > first ? p0 - first : 0;  // the first token that sees the block
      float* part = pa + u.part;
      std::fill(part + i0 * H * D, part + r.n * H * D, 0.0f);
      const float* vb = v_cache + int64_t(u.block) * BS * stride;
      for (int64_t p = p0; p < p1; ++p) {
        const float* vr = vb + (p - p0) * stride;
        for (int64_t i = p > first ? p - first : 0; i < r.n; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            const float wt = sc[r.scores + (i * H + h) * r.span + p];
            const float* vh = vr + (h / G) * D;
            float* a = part + (i * H + h) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] = std::fmaf(wt, vh[d], a[d]);
          }
        }
      }
    }
    // The shares added in block order, times 1 / sum.
    std::vector<float> acc(D);
#pragma omp for schedule(static)
    for (int64_t x = 0; x < n_pairs; ++x) {
      const int64_t ri = std::upper_bound(pair0, pair0 + R + 1, x) - pair0 - 1;
      const Short& r = rows[ri];
      const int64_t pr = x - pair0[ri], i = pr / H;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j <= (r.L - r.n + i) / BS; ++j) add(acc.data(), pa + uses[use_at[r.uses + j]].part + pr * D, D);
      float* o = r.out + pr * D;
      const float ix = iv[x];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * ix;
    }
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
  // Rows of up to SWEEP tokens go through ``sweep``, every block of theirs in the pool's order; longer ones (prefill
  // chunks) by items.
  std::vector<Short> shorts;
  std::vector<Use> uses;
  std::vector<int64_t> longs;
  int64_t n_scores = 0, n_parts = 0;
  for (int64_t r = 0; r < S; ++r) {
    const int64_t n = starts[r + 1] - starts[r], L = lens[r];
    if (n == 0) continue;
    if (n > SWEEP) {
      longs.push_back(r);
      continue;
    }
    const int64_t span = (L + KT - 1) / KT * KT, blocks = (L + BS - 1) / BS;
    const int32_t row = int32_t(shorts.size());
    shorts.push_back({q + starts[r] * H * D, out + starts[r] * H * D, L, n, n_scores, span, int64_t(uses.size())});
    n_scores += n * H * span;
    for (int64_t j = 0; j < blocks; ++j) {
      uses.push_back({tables[r * MB + j], row, int32_t(j), n_parts});
      n_parts += n * H * D;
    }
  }
  if (!shorts.empty()) {
    std::sort(uses.begin(), uses.end(), [](const Use& a, const Use& b) {
      return a.block != b.block ? a.block < b.block : a.row != b.row ? a.row < b.row : a.j < b.j;
    });
    sweep(shorts, uses, n_scores, n_parts, k_cache, v_cache, shape, threads);
  }
  if (longs.empty()) return;
  // Items, row-major: (row, tile of its tokens), then the KV head. Fewer rows than threads (one long row): tiles of
  // fewer tokens, so that each thread has some (a tile's size never changes a token's result).
  int64_t qt = QT;
  if (int64_t(longs.size()) < threads) {
    int64_t longest = 1;
    for (int64_t s : longs) longest = std::max<int64_t>(longest, starts[s + 1] - starts[s]);
    qt = std::min<int64_t>(QT, (longest + threads - 1) / threads);
  }
  std::vector<int64_t> tile_row, tile_start;
  for (int64_t s : longs) {
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
