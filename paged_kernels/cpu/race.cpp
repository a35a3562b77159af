// The sampler's draw for rows that keep their whole vocabulary (paged_kernels/cpu_race.py, executor_svc/sampler.py),
// compiled into the same library as attention.cpp. Plain C ABI, called through ctypes.
#include <cmath>
#include <cstdint>

// A sampled row's draw over its whole vocabulary, the Gumbel-max form of the exponential race:
// argmax_i x_i - log(-log(u_i)) (``x`` the scaled logits; equal to argmax p_i / E_i with E_i = -log u_i). u_i is the
// top 24 bits of SplitMix64(key + (i + 1) * golden ratio), the same hash the sampler's filtered rows use, so a row's
// draw is a function of (key, logits) only: not of the batch, the thread or the row's place in it. Float logs by a
// Cephes polynomial, so the loop vectorises (one 49,152-token row in ~0.1 ms against ~1 ms for torch's
// per-row ``exponential_``). Ties go to the lowest id. Masked tokens (-inf) never win unless every one is.
namespace race {
constexpr uint64_t MIX = 0x9E3779B97F4A7C15ull, M1 = 0xBF58476D1CE4E5B9ull, M2 = 0x94D049BB133111EBull;
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * M1;
  z = (z ^ (z >> 27)) * M2;
  return z ^ (z >> 31);
}
// log(x) for x > 0 normal: x = 2^e * m, m in [sqrt(.5), sqrt(2)), Cephes logf polynomial.
inline float logf_fast(float x) {
  int32_t i = __builtin_bit_cast(int32_t, x);
  int32_t e = ((i >> 23) & 0xff) - 126;
  float m = __builtin_bit_cast(float, (i & 0x007fffff) | 0x3f000000);  // [0.5, 1)
  const bool small = m < 0.70710678f;
  e = small ? e - 1 : e;
  m = small ? m + m - 1.0f : m - 1.0f;
  float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * float(e);
  y += -0.5f * z;
  return m + y + 0.693359375f * float(e);
}
}  // namespace race

extern "C" void race_f32(const float* x, const int64_t* keys, int64_t S, int64_t V, int32_t threads, int64_t* out) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t s = 0; s < S; ++s) {
    const float* r = x + s * V;
    const uint64_t key = uint64_t(keys[s]);
    constexpr int64_t W = 16;
    float best[W]; int64_t arg[W];
    for (int64_t l = 0; l < W; ++l) { best[l] = -INFINITY; arg[l] = 0; }
    int64_t i0 = 0;
    for (; i0 + W <= V; i0 += W) {
      float g[W];
#pragma omp simd
      for (int64_t l = 0; l < W; ++l) {
        const uint64_t z = race::mix64(key + uint64_t(i0 + l + 1) * race::MIX);
        const float u = (float(z >> 40) + 0.5f) * (1.0f / 16777216.0f);  // 24 bits, in (0, 1)
        g[l] = r[i0 + l] - race::logf_fast(-race::logf_fast(u));
      }
      for (int64_t l = 0; l < W; ++l) if (g[l] > best[l]) { best[l] = g[l]; arg[l] = i0 + l; }
    }
    float b = -INFINITY; int64_t a = 0;
    for (int64_t l = 0; l < W; ++l) if (best[l] > b || (best[l] == b && arg[l] < a)) { b = best[l]; a = arg[l]; }
    for (int64_t i = i0; i < V; ++i) {
      const uint64_t z = race::mix64(key + uint64_t(i + 1) * race::MIX);
      const float u = (float(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
      const float g = r[i] - race::logf_fast(-race::logf_fast(u));
      if (g > b) { b = g; a = i; }
    }
    out[s] = a;
  }
}
