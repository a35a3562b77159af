// Paged attention on CPU for rows of a few new tokens (a decode, a decode with drafts to verify), K/V read in place
// from the block pool (no gather into a padded tensor). Plain C ABI, called through ctypes (paged_kernels/cpu_decode.py); OpenMP is the runtime torch
// already loaded (same soname), so its threads are the forward's.
//
// Per row: the scores of each new token's H query heads against every position it sees (causal: new token i of n
// sits at position L - n + i; each position's K row holds all KVH heads contiguously: read once, used by every
// new token and query head that sees it), a softmax per (token, head) (max-subtracted, normalised before the
// weighted sum), then the weighted sum of V rows. fp32 throughout. Rows are the parallel
// items; with fewer rows than threads, (row, KV head) pairs are, so that one row still uses every thread.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// exp(x) for x <= 0 (scores minus their max), vectorisable: x = n ln2 + r (Cody-Waite), exp(r) by Cephes' expf
// polynomial (within 2 ulp of exp), times 2^n built in the exponent bits (the loop vectorises with
// -fno-trapping-math; libm's expf does not). Below -87 it gives exp(-87) (~1.6e-38, nothing beside the max's 1).
static inline float exp_nonpositive(float x) {
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

extern "C" void paged_attention_f32(
    const float* q,          // [T, H, D]: the rows' new tokens, row after row
    const float* k_cache,    // [num_blocks, BS, KVH, D]
    const float* v_cache,    // [num_blocks, BS, KVH, D]
    const int32_t* tables,   // [S, MB] physical block of each logical block
    const int32_t* lens,     // [S] context length, the new tokens included
    const int32_t* starts,   // [S + 1] each row's first token in q
    float* out,              // [T, H, D]
    int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale, int32_t threads) {
  const int64_t G = H / KVH;
  const int64_t split = S >= threads ? 1 : KVH;  // parts of a row: all its heads, or one KV head's group each
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < S * split; ++item) {
      const int64_t s = item / split, h0 = (item % split) * (H / split), h1 = h0 + H / split;
      const int64_t L = lens[s], t0 = starts[s], n = starts[s + 1] - t0, first = L - n;
      scores.resize(n * H * L);
      const int32_t* table = tables + s * MB;
      for (int64_t p = 0; p < L; ++p) {
        const float* krow = k_cache + (int64_t(table[p / BS]) * BS + p % BS) * KVH * D;
        for (int64_t i = p > first ? p - first : 0; i < n; ++i) {  // the new tokens that see position p
          const float* qi = q + (t0 + i) * H * D;
          for (int64_t h = h0; h < h1; ++h) {
            const float* k = krow + (h / G) * D;
            const float* qh = qi + h * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; ++d) acc += qh[d] * k[d];
            scores[(i * H + h) * L + p] = acc * scale;
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t seen = first + i + 1;
        for (int64_t h = h0; h < h1; ++h) {
          float* sc = scores.data() + (i * H + h) * L;
          float m = sc[0];
          for (int64_t p = 1; p < seen; ++p) m = sc[p] > m ? sc[p] : m;
#pragma omp simd
          for (int64_t p = 0; p < seen; ++p) sc[p] = exp_nonpositive(sc[p] - m);
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t p = 0; p < seen; ++p) sum += sc[p];
          const float inv = 1.0f / sum;
          for (int64_t p = 0; p < seen; ++p) sc[p] *= inv;
        }
        std::memset(out + ((t0 + i) * H + h0) * D, 0, sizeof(float) * (h1 - h0) * D);
      }
      for (int64_t p = 0; p < L; ++p) {
        const float* vrow = v_cache + (int64_t(table[p / BS]) * BS + p % BS) * KVH * D;
        for (int64_t i = p > first ? p - first : 0; i < n; ++i) {
          float* oi = out + (t0 + i) * H * D;
          for (int64_t h = h0; h < h1; ++h) {
            const float* v = vrow + (h / G) * D;
            const float w = scores[(i * H + h) * L + p];
            float* oh = oi + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) oh[d] += w * v[d];
          }
        }
      }
    }
  }
}
