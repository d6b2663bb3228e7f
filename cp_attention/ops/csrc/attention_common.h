// The SIMD core shared by the CPU attention kernels (paged, varlen, merge): 8-lane float
// vectors, exp2, 16-bit to float32 conversion, the online-softmax state and its finalize, the
// LSE merge of partials and the work queue.
//
// Vectors are GCC/Clang vector extensions (`vector_size(32)`): with -march=native they compile
// to AVX2/FMA (or AVX-512 halves, or NEON pairs) without intrinsics, and unlike
// at::vec::Vectorized they do not depend on the CPU_CAPABILITY macros ATen sets for its own
// per-ISA builds. Register tiling is explicit (the compiler does not find it by itself).
// Two score domains (ScoreBase): natural-log scores (paged: vexp) and base-2 scores (varlen:
// queries pre-scaled by scale * log2(e); vexp2), each with the exp measured fastest for it.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// bf16 dot products (vdpbf16ps: two exact bf16 products added per float32 lane) where the
// build targets a CPU with avx512_bf16 (Zen 4, Sapphire Rapids); kernels fall back to widening.
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define CP_HAS_BF16_DOT 1
#else
#define CP_HAS_BF16_DOT 0
#endif

namespace cp_attention {

#define CP_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 8;
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint16_t vu16x8 __attribute__((vector_size(16)));
typedef uint32_t vu32x8 __attribute__((vector_size(32)));

constexpr bool kHasBF16Dot = CP_HAS_BF16_DOT;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 8 bfloat16 / float16 values widened to float32 (a bfloat16 is the upper half of a float32).
inline vf8 load8(const c10::BFloat16* p) {
#if defined(__AVX2__)
  // one zero-extending load and one shift (GCC splits __builtin_convertvector in halves)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  vu16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32x8 w = __builtin_convertvector(h, vu32x8) << 16;
  vf8 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#endif
}

inline vf8 load8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf8 v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline void store8(float* p, vf8 v) { std::memcpy(p, &v, sizeof(v)); }

inline vf8 splat(float x) { return vf8{x, x, x, x, x, x, x, x}; }

inline vi8 splat_i(int32_t x) { return vi8{x, x, x, x, x, x, x, x}; }

inline vf8 vmax(vf8 a, vf8 b) { return a > b ? a : b; }

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer

// 2^x lane-wise (Cephes exp2f polynomial on [-0.5, 0.5], ~1 ulp). Lanes below -125 (including
// -inf and NaN) give exactly 0, so masked scores never leak into sums. (Faster than the
// Cephes expf of x ln 2: results/history.md section 15.)
CP_INLINE vf8 vexp2(vf8 x) {
  const vf8 lo = splat(-125.0f), hi = splat(125.0f);
  const vf8 xc = x < lo ? lo : (x > hi ? hi : x);
  const vf8 t = xc + splat(kRoundMagic);
  const vf8 f = xc - (t - splat(kRoundMagic));  // in [-0.5, 0.5]
  vf8 p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.0f);
  const vi8 valid = x >= lo;
  vi8 e, bits;
  std::memcpy(&e, &t, sizeof(e));
  std::memcpy(&bits, &p, sizeof(bits));
  bits = (bits + ((e - splat_i(0x4B400000)) << 23)) & valid;  // p * 2^round(x), 0 if invalid
  vf8 result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// e^x lane-wise (Cephes expf, ~1 ulp). Lanes below -87.3 (including -inf) give exactly 0.
// Faster in the decode than the exp2 polynomial fed with x log2(e) = n + f from a split log2(e)
// (equally accurate; results/history.md section 15); exp2(x log2(e)) would lose |x| ulps to the
// rounding of the product.
inline vf8 vexp(vf8 x) {
  const vf8 lo = splat(-87.3365447f), hi = splat(88.3762626f);
  const vf8 xc = x < lo ? lo : (x > hi ? hi : x);
  const vf8 t = xc * splat(1.44269504088896341f) + splat(kRoundMagic);
  const vf8 n = t - splat(kRoundMagic);
  vi8 ni;
  std::memcpy(&ni, &t, sizeof(ni));
  ni -= splat_i(0x4B400000);  // bits of kRoundMagic
  vf8 r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const vi8 bits = (ni + splat_i(127)) << 23;
  vf8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vf8 result = p * scale;
  return x < lo ? splat(0.0f) : result;
}

// ---- conversion of n contiguous elements to float32 ---------------------------------------
inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// A bfloat16 is the upper half of a float32: interleaving 16-bit zeros below the 8 halves
// gives 8 floats (two 128-bit unpacks, no widening shuffle or shift; results/history.md
// section 15).
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  const vu16x8 zero = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vu16x8 h;
    std::memcpy(&h, s + i, sizeof(h));
    const vu16x8 lo = __builtin_shufflevector(zero, h, 0, 8, 1, 9, 2, 10, 3, 11);
    const vu16x8 hi = __builtin_shufflevector(zero, h, 4, 12, 5, 13, 6, 14, 7, 15);
    std::memcpy(dst + i, &lo, sizeof(lo));
    std::memcpy(dst + i + kLanes / 2, &hi, sizeof(hi));
  }
  for (; i < n; ++i) {
    const uint32_t w = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &w, sizeof(w));
  }
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + kLanes <= n; i += kLanes) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n elements `stride` apart (contiguous: the vector paths above).
template <typename scalar_t>
inline void to_float(const scalar_t* src, int64_t stride, float* dst, int64_t n) {
  if (stride == 1) return to_float(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i * stride]);
}

// ---- online softmax over lanes (one query row per lane) -----------------------------------
// What a score is the exponent of: e (kNatural: p = exp(s - m), lse = m + log(l)) or 2 (kTwo:
// p = 2^(s - m), lse = (m + log2(l)) ln 2).
enum class ScoreBase { kNatural, kTwo };

template <ScoreBase base>
CP_INLINE vf8 pow_base(vf8 x) {
  return base == ScoreBase::kTwo ? vexp2(x) : vexp(x);
}

// State of 8 query rows: running max m, running sum l (of exp(score - m)).
struct SoftmaxState {
  vf8 m = splat(kNegInf);
  vf8 l = splat(0.0f);
};

// The max the probabilities are taken against: m, or 0 for rows with nothing visible yet
// (m = -inf), so that -inf - -inf never reaches the exp.
CP_INLINE vf8 softmax_ref(vf8 m) { return m == splat(kNegInf) ? splat(0.0f) : m; }

// Folds a tile of n score vectors (scores + j * stride, one lane per row; -inf = masked) into
// `state`. Overwrites them with the probabilities base^(score - m_new) and returns the factor
// base^(m_old - m_new) by which each row's accumulator must be rescaled.
template <ScoreBase base>
CP_INLINE vf8 softmax_tile(SoftmaxState& state, float* scores, int64_t stride, int64_t n) {
  vf8 tile_max = splat(kNegInf);
  for (int64_t j = 0; j < n; ++j) tile_max = vmax(tile_max, load8(scores + j * stride));
  const vf8 m_new = vmax(state.m, tile_max);
  const vf8 ref = softmax_ref(m_new);  // rows with nothing visible yet keep m = -inf
  const vf8 alpha = pow_base<base>(state.m - ref);
  vf8 sum = splat(0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const vf8 p = pow_base<base>(load8(scores + j * stride) - ref);
    store8(scores + j * stride, p);
    sum += p;
  }
  state.l = state.l * alpha + sum;
  state.m = m_new;
  return alpha;
}

// out = acc / l and the natural-log lse for one row; a row without visible keys gives 0 / -inf.
template <ScoreBase base>
inline void finalize_row(const float* acc, float m, float l, int64_t dim, float* out,
                         float* lse) {
  if (l > 0.0f) {
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < dim; ++d) out[d] = acc[d] * inv;
    *lse = base == ScoreBase::kTwo ? (m + std::log2(l)) * kLn2 : m + std::log(l);
  } else {
    std::memset(out, 0, dim * sizeof(float));
    *lse = kNegInf;
  }
}

// ---- LSE merge of partials over disjoint key sets ----------------------------------------
// The weights w[i] = exp(lse[i * stride] - lse_merged) of n partials (summing to 1) and the
// merged lse (natural log); all -inf: weights 0 and -inf.
inline float merge_weights(const float* lse, int64_t stride, int64_t n, float* w) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, lse[i * stride]);
  if (m == kNegInf) {  // every part empty (also keeps -inf - -inf out of exp)
    std::fill(w, w + n, 0.0f);
    return kNegInf;
  }
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += (w[i] = std::exp(lse[i * stride] - m));
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < n; ++i) w[i] *= inv;
  return m + std::log(total);
}

// ---- work queue ---------------------------------------------------------------------------
// Runs work(i, state) for i in [0, n) on min(at::get_num_threads(), n) workers that take the
// items in order (dynamic: the caller sorts long items first); each worker makes its own
// `state` (scratch buffers) once with make_state().
template <typename MakeState, typename Work>
void run_queue(int64_t n, const MakeState& make_state, const Work& work) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const auto drain = [&] {
    decltype(auto) state = make_state();  // a value, or a reference to a thread's own
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(i, state);
  };
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  if (workers <= 1) return drain();
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { drain(); });
}

}  // namespace cp_attention
