// The ceilings of one CPU core, for bench_cpu_ops' per-row lower bound (docs/performance.md
// section 12): the multiply-add peak (fp32 FMA; bf16 pairs with vdpbf16ps where the CPU has
// them) and the read bandwidth over a buffer of a given size (warm: from L1, L2, L3 or memory
// by its size). Independent accumulator chains, so throughput, not latency, limits; each
// returns its rate.
// Built by benchmarks/cpu_limits.py with -O3 -march=native; benchmark code, not a kernel.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

volatile float sink;  // keeps the accumulators live

constexpr int kChains = 12;  // > FMA latency x FMA ports on every x86 core we run on

// GFLOP/s of kChains chains acc = fma(acc, a, b), each op worth `flops_per_op`.
template <class Acc, class In, class Fma, class Sum>
double peak(int64_t iters, Acc init, In a, In b, double flops_per_op, Fma fma, Sum sum) {
  Acc acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = init;
  const double start = seconds();
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = fma(acc[c], a, b);
  const double elapsed = seconds() - start;
  float total = 0.f;
  for (int c = 0; c < kChains; ++c) total += sum(acc[c]);
  sink = total;
  return flops_per_op * kChains * static_cast<double>(iters) / elapsed / 1e9;
}

}  // namespace

extern "C" {

// fp32 multiply-adds, 2 flops each: the widest of ymm and zmm (a core may split zmm in two).
double fp32_fma_gflops(int64_t iters) {
  double best = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
  {
    auto sum = [](__m256 v) {
      float x[8];
      _mm256_storeu_ps(x, v);
      return x[0];
    };
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    const double r = peak(iters, a, a, b, 16.0,
                          [](__m256 c, __m256 a, __m256 b) { return _mm256_fmadd_ps(c, a, b); },
                          sum);
    best = r > best ? r : best;
  }
#endif
#if defined(__AVX512F__)
  {
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    const double r = peak(iters, a, a, b, 32.0,
                          [](__m512 c, __m512 a, __m512 b) { return _mm512_fmadd_ps(c, a, b); },
                          [](__m512 v) { return _mm512_reduce_add_ps(v); });
    best = r > best ? r : best;
  }
#endif
  return best;
}

// bf16 pairs into fp32 lanes (vdpbf16ps: 2 products and 2 adds per lane); 0 without them.
double bf16_dot_gflops(int64_t iters) {
#if defined(__AVX512BF16__)
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3a83);  // bf16 ~1e-3
  return peak(iters, _mm512_setzero_ps(), a, b, 64.0,
              [](__m512 c, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(c, a, b); },
              [](__m512 v) { return _mm512_reduce_add_ps(v); });
#else
  (void)iters;
  return 0.0;
#endif
}

// GB/s reading `bytes` (a multiple of 512) once, best of `passes` after one warm pass.
double read_gbs(int64_t bytes, int64_t passes) {
  float* data = static_cast<float*>(std::aligned_alloc(64, bytes));
  std::memset(data, 0, bytes);
  const int64_t n = bytes / 4;
  double best = 1e30;
  float total = 0.f;
  for (int64_t p = 0; p <= passes; ++p) {
    const double start = seconds();
#if defined(__AVX512F__)
    __m512 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 128)
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_load_ps(data + i + 16 * c));
    for (int c = 0; c < 8; ++c) total += _mm512_reduce_add_ps(acc[c]);
#else
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 64)
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_add_ps(acc[c], _mm256_load_ps(data + i + 8 * c));
    float x[8];
    for (int c = 0; c < 8; ++c) {
      _mm256_storeu_ps(x, acc[c]);
      total += x[0];
    }
#endif
    const double elapsed = seconds() - start;
    if (p > 0 && elapsed < best) best = elapsed;  // pass 0 warms the caches
  }
  sink = total;
  std::free(data);
  return static_cast<double>(bytes) / best / 1e9;
}

}  // extern "C"
