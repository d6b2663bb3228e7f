// Causal / varlen prefill attention on CPU with log-sum-exp.
//
// Flash-attention style: one work item is (request, kv head, tile of query tokens); its query
// rows for all heads of the GQA group are packed transposed, Q^T [D, M] (M = tokens x group,
// pre-scaled by scale * log2(e)), and it walks the request's visible keys in tiles of kBlockK:
//   S^T [kn, M] = K_tile Q^T        (register-blocked micro-kernel, keys x query columns)
//   online softmax along keys       (vectorized across query columns, base-2 exponent)
//   O [M, D] = alpha * O + P V_tile (same micro-kernel, query rows x head dims)
// Key tiles outside every row's causal / window range are skipped; only tiles that cross a
// row's range boundary are masked. Each K/V tile is read once for the whole query group.
// Float32 K/V rows are read in place (unless 2 KB apart: L1 set conflicts); other rows are
// converted or copied tile by tile into a small float32 buffer (never the whole tensor). With
// bf16 q/k on a CPU with avx512_bf16, S^T comes from bf16 dot products instead (vdpbf16ps:
// pairs of exact products, float32 sums): K read in place, queries unscaled, scores scaled;
// P V stays float32. Work items run request by request (longest requests first), each KV
// head's items in a row, longest first (its K/V stay in cache), handed out dynamically to
// at::get_num_threads() threads. Vectors, exp2, the conversions, the softmax state and the work
// queue are attention_common.h's.
#include "varlen_attention.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_common.h"

namespace cp_attention {
namespace {

constexpr int64_t kBlockK = 96;       // keys per tile
constexpr int64_t kTargetRows = 192;  // query rows (tokens x group heads) per work item
constexpr ScoreBase kBase = ScoreBase::kTwo;  // scores q . k * scale * log2(e)

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------------------------------------
// Micro-kernel: C[MR, 8 * NV] (=|+=) A[MR, kdim] B[kdim, 8 * NV].
// A element (r, k) at a[r * a_rs + k * a_ks] (broadcast), B row k at b[k * b_ks] (vectors),
// C row r at c[r * c_rs]. ACC: C = row_scale[r] * C + A B, else C = A B.
template <int MR, int NV, bool ACC>
inline void micro_kernel(const float* __restrict a, int64_t a_rs, int64_t a_ks,
                         const float* __restrict b, int64_t b_ks, float* __restrict c,
                         int64_t c_rs, int64_t kdim, const float* __restrict row_scale) {
  vf8 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const vf8 s = ACC ? splat(row_scale[r]) : splat(0.0f);
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n)
      acc[r][n] = ACC ? load8(c + r * c_rs + n * kLanes) * s : s;
  }
  for (int64_t k = 0; k < kdim; ++k) {
    vf8 bv[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) bv[n] = load8(b + n * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vf8 av = splat(a[r * a_rs]);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) acc[r][n] += av * bv[n];
    }
    a += a_ks;
    b += b_ks;
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) store8(c + r * c_rs + n * kLanes, acc[r][n]);
}

// Block of the float32 micro-kernel: kGemmRows x 2 accumulator vectors plus 2 B vectors and
// a broadcast must stay in registers (8 x 2 with AVX-512's 32; 6 x 2 fills AVX2's 16;
// results/history.md section 15).
#if defined(__AVX512F__)
constexpr int kGemmRows = 8;
#else
constexpr int kGemmRows = 6;
#endif

// micro_kernel<rows, NV, ACC> for 1 <= rows <= MR.
template <int NV, bool ACC, int MR = kGemmRows>
inline void micro_rows(int rows, const float* a, int64_t a_rs, int64_t a_ks, const float* b,
                       int64_t b_ks, float* c, int64_t c_rs, int64_t kdim,
                       const float* row_scale) {
  if constexpr (MR > 1) {
    if (rows < MR)
      return micro_rows<NV, ACC, MR - 1>(rows, a, a_rs, a_ks, b, b_ks, c, c_rs, kdim, row_scale);
  }
  micro_kernel<MR, NV, ACC>(a, a_rs, a_ks, b, b_ks, c, c_rs, kdim, row_scale);
}

// C[rows, cols] (=|+=) A B with cols a multiple of 8: blocks of kGemmRows x 16 columns.
template <bool ACC>
void small_gemm(int64_t rows, int64_t cols, const float* a, int64_t a_rs, int64_t a_ks,
                const float* b, int64_t b_ks, float* c, int64_t c_rs, int64_t kdim,
                const float* row_scale) {
  for (int64_t j = 0; j < cols; j += 2 * kLanes) {
    for (int64_t i = 0; i < rows; i += kGemmRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kGemmRows, rows - i));
      const float* scale_i = ACC ? row_scale + i : nullptr;
      if (cols - j >= 2 * kLanes)
        micro_rows<2, ACC>(mr, a + i * a_rs, a_rs, a_ks, b + j, b_ks, c + i * c_rs + j, c_rs,
                           kdim, scale_i);
      else
        micro_rows<1, ACC>(mr, a + i * a_rs, a_rs, a_ks, b + j, b_ks, c + i * c_rs + j, c_rs,
                           kdim, scale_i);
    }
  }
}

#if CP_HAS_BF16_DOT
// S^T [kn, cols] = scale * K Q^T over bf16 pairs (vdpbf16ps; two exact products per lane):
// key r's pair p is the 32-bit word at keys + r * k_rs + 2p (bf16 K read in place, broadcast),
// row p of Q^T at q_pairs + p * q_ps holds query column i's elements 2p, 2p + 1 in lane i.
template <int MR, int NV>
inline void micro_kernel_bf16(const c10::BFloat16* __restrict keys, int64_t k_rs,
                              const uint32_t* __restrict q_pairs, int64_t q_ps,
                              float* __restrict c, int64_t c_rs, int64_t pairs, float scale) {
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) acc[r][n] = _mm256_setzero_ps();
  const uint16_t* k = reinterpret_cast<const uint16_t*>(keys);
  for (int64_t p = 0; p < pairs; ++p) {
    __m256bh qv[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n)
      qv[n] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q_pairs + n * kLanes));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t bits;
      std::memcpy(&bits, k + r * k_rs + 2 * p, sizeof(bits));
      const __m256bh kv = (__m256bh)_mm256_set1_epi32(bits);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) acc[r][n] = _mm256_dpbf16_ps(acc[r][n], kv, qv[n]);
    }
    q_pairs += q_ps;
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n)
      _mm256_storeu_ps(c + r * c_rs + n * kLanes, _mm256_mul_ps(acc[r][n], _mm256_set1_ps(scale)));
}

// Block of the bf16 micro-kernel: 8 keys x 3 vectors of query columns, 24 accumulators (and 3
// Q vectors and a broadcast) of the 32 registers every avx512_bf16 CPU has (results/history.md
// section 15).
constexpr int kDotKeys = 8;
constexpr int kDotVecs = 3;

// micro_kernel_bf16<rows, NV> for 1 <= rows <= MR.
template <int NV, int MR = kDotKeys>
inline void micro_rows_bf16(int rows, const c10::BFloat16* keys, int64_t k_rs,
                            const uint32_t* q_pairs, int64_t q_ps, float* c, int64_t c_rs,
                            int64_t pairs, float scale) {
  if constexpr (MR > 1) {
    if (rows < MR)
      return micro_rows_bf16<NV, MR - 1>(rows, keys, k_rs, q_pairs, q_ps, c, c_rs, pairs, scale);
  }
  micro_kernel_bf16<MR, NV>(keys, k_rs, q_pairs, q_ps, c, c_rs, pairs, scale);
}

// S^T [kn, cols] = scale * K Q^T for bf16 K rows k_rs apart and Q^T pairs [pairs, cols], cols a
// multiple of 8: blocks of kDotKeys keys x kDotVecs vectors of query columns.
void qk_gemm_bf16(int64_t kn, int64_t cols, const c10::BFloat16* keys, int64_t k_rs,
                  const uint32_t* q_pairs, float* c, int64_t pairs, float scale) {
  for (int64_t j = 0; j < cols; j += kDotVecs * kLanes) {
    const int64_t vecs = std::min<int64_t>(kDotVecs, (cols - j) / kLanes);
    for (int64_t i = 0; i < kn; i += kDotKeys) {
      const int mr = static_cast<int>(std::min<int64_t>(kDotKeys, kn - i));
      const auto run = [&](auto nv) {
        micro_rows_bf16<decltype(nv)::value>(mr, keys + i * k_rs, k_rs, q_pairs + j, cols,
                                             c + i * cols + j, cols, pairs, scale);
      };
      if (vecs == 3) run(std::integral_constant<int, 3>());
      else if (vecs == 2) run(std::integral_constant<int, 2>());
      else run(std::integral_constant<int, 1>());
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
struct WorkItem {
  int64_t request;
  int64_t kv_head;
  int64_t token_start;  // first query token of the tile, relative to the request
  int64_t num_tokens;
  int64_t cost;
};

template <typename scalar_t>
struct Problem {
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  int64_t q_stride[3];
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t num_q_heads;
  int64_t group;
  int64_t head_size;
  int64_t head_size_padded;  // multiple of 8; == head_size when K/V are read in place
  bool kv_in_place;          // float32 K/V, contiguous rows of D % 8 == 0, not 2 KB apart
  bool bf16_dot;             // bf16 q/k, contiguous K rows, even D, avx512_bf16: K in place,
                             // scores from bf16 pairs (queries unscaled, scores scaled)
  float scale_log2;          // softmax scale * log2(e)
  bool causal;
  int64_t window;            // <= 0: none
  const int64_t* cu_q;
  const int64_t* cu_k;
  const int64_t* nk;  // [R] keys each request attends: its cu_k range, or seqused_k
  float* out;  // [Tq, Hq, D] contiguous
  float* lse;  // [Tq, Hq] contiguous
};

// Per-thread buffers, sized for the largest work item.
struct Scratch {
  std::vector<float> q_t;      // [Dp, Mp]  Q^T, scaled (not with bf16_dot)
  std::vector<uint32_t> q_pairs;  // [Dp / 2, Mp]  Q^T as bf16 pairs, unscaled (bf16_dot only)
  std::vector<float> scores;   // [kBlockK, Mp]  S^T, then P^T
  std::vector<float> acc;      // [Mp, Dp]  unnormalized output rows
  std::vector<SoftmaxState> state;  // [Mp / 8] running max (log2 domain) and sum of 8 rows
  std::vector<float> rescale;  // [Mp] alpha of the current tile
  std::vector<float> q_pos;    // [Mp] key position of each query row
  std::vector<float> q_lo;     // [Mp] first visible key position (window) or very negative
  std::vector<float> k_tile;   // [kBlockK, Dp]  converted keys (not in place, not bf16_dot)
  std::vector<float> v_tile;   // [kBlockK, Dp]
  Scratch(int64_t max_rows, int64_t dp, bool bf16_dot)
      : q_t(bf16_dot ? 0 : dp * round_up(max_rows, kLanes)),
        q_pairs(bf16_dot ? dp / 2 * round_up(max_rows, kLanes) : 0),
        scores(kBlockK * round_up(max_rows, kLanes)),
        acc(round_up(max_rows, kLanes) * dp), state(round_up(max_rows, kLanes) / kLanes),
        rescale(round_up(max_rows, kLanes)),
        q_pos(round_up(max_rows, kLanes)), q_lo(round_up(max_rows, kLanes)),
        k_tile(bf16_dot ? 0 : kBlockK * dp, 0.0f), v_tile(kBlockK * dp, 0.0f) {}
};

// Visible key range [lo, hi) of a tile of queries whose key positions are [p_lo, p_hi].
struct KeyRange {
  int64_t lo;
  int64_t hi;
};

inline KeyRange visible_keys(bool causal, int64_t window, int64_t nk, int64_t p_lo,
                             int64_t p_hi) {
  if (!causal) return {0, nk};
  const int64_t hi = std::clamp<int64_t>(p_hi + 1, 0, nk);
  const int64_t lo = window > 0 ? std::clamp<int64_t>(p_lo - window + 1, 0, nk) : 0;
  return {lo, std::max(lo, hi)};
}

// Online-softmax update over one tile of scores (in place: S^T -> P^T, alpha -> rescale).
// masked: first hide the keys outside each query row's causal / window bounds.
void mask_and_softmax(Scratch& s, int64_t mp, int64_t kn, int64_t key0, bool masked) {
  float* st = s.scores.data();
  for (int64_t i = 0; i < mp; i += kLanes) {
    if (masked) {
      const vf8 hi = load8(s.q_pos.data() + i), lo = load8(s.q_lo.data() + i);
      for (int64_t j = 0; j < kn; ++j) {
        const vf8 key = splat(static_cast<float>(key0 + j)), x = load8(st + j * mp + i);
        store8(st + j * mp + i, (key >= lo) & (key <= hi) ? x : splat(kNegInf));
      }
    }
    store8(s.rescale.data() + i, softmax_tile<kBase>(s.state[i / kLanes], st + i, mp, kn));
  }
}

template <typename scalar_t>
void attend_item(const Problem<scalar_t>& pr, const WorkItem& w, Scratch& s) {
  const int64_t group = pr.group, dim = pr.head_size, dp = pr.head_size_padded;
  const int64_t q_begin = pr.cu_q[w.request], k_begin = pr.cu_k[w.request];
  const int64_t nq = pr.cu_q[w.request + 1] - q_begin, nk = pr.nk[w.request];
  const int64_t rows = w.num_tokens * group, mp = round_up(rows, kLanes);
  const int64_t first_head = w.kv_head * group;
  const int64_t p_lo = nk - nq + w.token_start, p_hi = p_lo + w.num_tokens - 1;

  // Q^T [dp, mp] (or its bf16 pairs [dim / 2, mp]), row index i = token * group +
  // head-in-group; padding stays 0.
  float* q_t = s.q_t.data();
  uint32_t* q_pairs = s.q_pairs.data();
  if (pr.bf16_dot)
    std::fill(q_pairs, q_pairs + dim / 2 * mp, 0u);
  else
    std::fill(q_t, q_t + dp * mp, 0.0f);
  for (int64_t t = 0; t < w.num_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const scalar_t* src = pr.q + (q_begin + w.token_start + t) * pr.q_stride[0] +
                            (first_head + g) * pr.q_stride[1];
      const int64_t i = t * group + g;
      if (pr.bf16_dot) {
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
          for (int64_t p = 0; p < dim / 2; ++p)
            q_pairs[p * mp + i] = static_cast<uint32_t>(src[2 * p * pr.q_stride[2]].x) |
                                  static_cast<uint32_t>(src[(2 * p + 1) * pr.q_stride[2]].x) << 16;
      } else {
        for (int64_t d = 0; d < dim; ++d)
          q_t[d * mp + i] = static_cast<float>(src[d * pr.q_stride[2]]) * pr.scale_log2;
      }
    }
  }
  for (int64_t i = 0; i < mp; ++i) {
    const int64_t pos = std::min(p_lo + i / group, p_hi);
    s.q_pos[i] = static_cast<float>(pos);
    s.q_lo[i] = pr.window > 0 ? static_cast<float>(pos - pr.window + 1) : -3.0e38f;
  }
  std::fill(s.state.begin(), s.state.begin() + mp / kLanes, SoftmaxState());
  float* acc = s.acc.data();
  std::fill(acc, acc + mp * dp, 0.0f);

  const KeyRange range = visible_keys(pr.causal, pr.window, nk, p_lo, p_hi);
  for (int64_t k0 = range.lo; k0 < range.hi; k0 += kBlockK) {
    const int64_t kn = std::min(kBlockK, range.hi - k0);
    const float* k_rows;
    const float* v_rows;
    int64_t k_ld, v_ld;
    const scalar_t* k_src = pr.k + (k_begin + k0) * pr.k_stride[0] + w.kv_head * pr.k_stride[1];
    const scalar_t* v_src = pr.v + (k_begin + k0) * pr.v_stride[0] + w.kv_head * pr.v_stride[1];
    if (pr.kv_in_place) {
      k_rows = reinterpret_cast<const float*>(k_src);
      v_rows = reinterpret_cast<const float*>(v_src);
      k_ld = pr.k_stride[0];
      v_ld = pr.v_stride[0];
    } else {
      for (int64_t j = 0; j < kn; ++j) {
        if (!pr.bf16_dot)
          to_float(k_src + j * pr.k_stride[0], pr.k_stride[2], s.k_tile.data() + j * dp, dim);
        to_float(v_src + j * pr.v_stride[0], pr.v_stride[2], s.v_tile.data() + j * dp, dim);
      }
      k_rows = s.k_tile.data();
      v_rows = s.v_tile.data();
      k_ld = v_ld = dp;
    }
    // S^T [kn, mp] = K Q^T
    if (pr.bf16_dot) {
      if constexpr (kHasBF16Dot && std::is_same_v<scalar_t, c10::BFloat16>)
        qk_gemm_bf16(kn, mp, k_src, pr.k_stride[0], q_pairs, s.scores.data(), dim / 2,
                     pr.scale_log2);
    } else {
      small_gemm<false>(kn, mp, k_rows, k_ld, 1, q_t, mp, s.scores.data(), mp, dp, nullptr);
    }
    const bool inside = !pr.causal || (k0 + kn - 1 <= p_lo &&
                                       (pr.window <= 0 || k0 >= p_hi - pr.window + 1));
    mask_and_softmax(s, mp, kn, k0, !inside);
    // O [rows, dp] = alpha * O + P V
    small_gemm<true>(rows, dp, s.scores.data(), 1, mp, v_rows, v_ld, acc, dp, kn,
                     s.rescale.data());
  }

  for (int64_t t = 0; t < w.num_tokens; ++t) {
    const int64_t token = q_begin + w.token_start + t;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i = t * group + g, head = first_head + g;
      const int64_t o = token * pr.num_q_heads + head;
      const SoftmaxState& st = s.state[i / kLanes];
      finalize_row<kBase>(acc + i * dp, st.m[i % kLanes], st.l[i % kLanes], dim,
                          pr.out + o * dim, pr.lse + o);
    }
  }
}

template <typename scalar_t>
void run_varlen(const Problem<scalar_t>& pr, int64_t num_requests, int64_t num_kv_heads) {
  const int64_t tokens_per_item = std::max<int64_t>(1, kTargetRows / pr.group);
  std::vector<WorkItem> items;
  std::vector<int64_t> lead(num_requests, 0);  // the cost of each request's longest item
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t nq = pr.cu_q[r + 1] - pr.cu_q[r], nk = pr.nk[r];
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t t0 = 0; t0 < nq; t0 += tokens_per_item) {
        const int64_t tn = std::min(tokens_per_item, nq - t0);
        const int64_t p_lo = nk - nq + t0;
        const KeyRange range = visible_keys(pr.causal, pr.window, nk, p_lo, p_lo + tn - 1);
        const int64_t cost = tn * pr.group * (range.hi - range.lo + 8);
        items.push_back({r, h, t0, tn, cost});
        lead[r] = std::max(lead[r], cost);
      }
    }
  }
  // Requests with the longest items first (the queue ends on short items), then one KV head's
  // items in a row, longest first: the head's K/V stay in cache (and TLB) for them.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    if (lead[a.request] != lead[b.request]) return lead[a.request] > lead[b.request];
    if (a.request != b.request) return a.request < b.request;
    if (a.kv_head != b.kv_head) return a.kv_head < b.kv_head;
    return a.cost > b.cost;
  });
  const int64_t max_rows = tokens_per_item * pr.group;
  run_queue(static_cast<int64_t>(items.size()),
            [&] { return Scratch(max_rows, pr.head_size_padded, pr.bf16_dot); },
            [&](int64_t i, Scratch& s) { attend_item(pr, items[i], s); });
}

std::vector<int64_t> offsets(const at::Tensor& cu, const char* name) {
  TORCH_CHECK_VALUE(cu.dim() == 1 &&
                    (cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong),
                    name, " must be a 1-D int32/int64 tensor");
  const at::Tensor c = cu.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> bounds(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  TORCH_CHECK_VALUE(!bounds.empty() && bounds[0] == 0, name, " must start at 0");
  for (size_t i = 1; i < bounds.size(); ++i)
    TORCH_CHECK_VALUE(bounds[i] >= bounds[i - 1], name, " must be non-decreasing");
  return bounds;
}

template <typename scalar_t>
void launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k,
            const std::vector<int64_t>& nk, double scale, bool causal, int64_t window,
            at::Tensor& out, at::Tensor& lse) {
  Problem<scalar_t> pr;
  pr.q = q.data_ptr<scalar_t>();
  pr.k = k.data_ptr<scalar_t>();
  pr.v = v.data_ptr<scalar_t>();
  for (int d = 0; d < 3; ++d) {
    pr.q_stride[d] = q.stride(d);
    pr.k_stride[d] = k.stride(d);
    pr.v_stride[d] = v.stride(d);
  }
  pr.num_q_heads = q.size(1);
  pr.group = q.size(1) / k.size(1);
  pr.head_size = q.size(2);
  // float32 K/V rows read in place unless other heads lie between them and they are a multiple
  // of 2 KB apart (8 heads of 64): then a tile's rows share a few L1 sets, and copying the
  // tile costs less than the conflict misses
  const auto aliased = [&](int64_t row_stride) {
    return row_stride != pr.head_size && row_stride % 512 == 0;
  };
  pr.kv_in_place = std::is_same<scalar_t, float>::value && k.stride(2) == 1 &&
                   v.stride(2) == 1 && pr.head_size % kLanes == 0 &&
                   !aliased(k.stride(0)) && !aliased(v.stride(0));
  pr.bf16_dot = kHasBF16Dot && std::is_same<scalar_t, c10::BFloat16>::value &&
                k.stride(2) == 1 && pr.head_size % 2 == 0;
  pr.head_size_padded = round_up(pr.head_size, kLanes);
  pr.scale_log2 = static_cast<float>(scale) * kLog2e;
  pr.causal = causal;
  pr.window = window;
  pr.cu_q = cu_q.data();
  pr.cu_k = cu_k.data();
  pr.nk = nk.data();
  pr.out = out.data_ptr<float>();
  pr.lse = lse.data_ptr<float>();
  run_varlen(pr, static_cast<int64_t>(cu_q.size()) - 1, k.size(1));
}

}  // namespace
}  // namespace cp_attention

using namespace cp_attention;

std::tuple<at::Tensor, at::Tensor> varlen_attention_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, double scale, bool causal,
    int64_t window, const std::optional<at::Tensor>& seqused_k) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
                    "varlen_attention_cpu: tensors must be on the CPU");
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
                    "varlen_attention_cpu: q [Tq, Hq, D], k/v [Tk, Hkv, D] expected");
  TORCH_CHECK_VALUE(q.size(2) == k.size(2) && q.size(2) > 0 && k.size(1) > 0 && q.size(1) > 0 &&
                        q.size(1) % k.size(1) == 0,
                    "varlen_attention_cpu: head sizes differ or Hq % Hkv != 0");
  TORCH_CHECK_VALUE(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
                    "varlen_attention_cpu: q, k, v must share one dtype");
  TORCH_CHECK_VALUE(window <= 0 || causal, "varlen_attention_cpu: a sliding window needs causal");
  TORCH_CHECK_VALUE(k.size(0) < (int64_t{1} << 24),
                    "varlen_attention_cpu: key positions must stay below 2^24");
  const std::vector<int64_t> cu_q = offsets(cu_seqlens_q, "cu_seqlens_q");
  const std::vector<int64_t> cu_k = offsets(cu_seqlens_k, "cu_seqlens_k");
  TORCH_CHECK_VALUE(cu_q.size() == cu_k.size() && !cu_q.empty() && cu_q.back() == q.size(0) &&
                        cu_k.back() == k.size(0),
                    "varlen_attention_cpu: cu_seqlens do not match the tensors");
  const int64_t num_requests = static_cast<int64_t>(cu_k.size()) - 1;
  std::vector<int64_t> nk(num_requests);
  for (int64_t r = 0; r < num_requests; ++r) nk[r] = cu_k[r + 1] - cu_k[r];
  if (seqused_k.has_value()) {  // request r attends the first seqused_k[r] keys of its range
    const at::Tensor& used_in = *seqused_k;
    TORCH_CHECK_VALUE(used_in.dim() == 1 && used_in.numel() == num_requests &&
                          (used_in.scalar_type() == at::kInt || used_in.scalar_type() == at::kLong),
                      "varlen_attention_cpu: seqused_k must be a 1-D int32/int64 tensor of ",
                      num_requests, " requests");
    const at::Tensor used = used_in.to(at::kCPU, at::kLong).contiguous();
    const int64_t* u = used.data_ptr<int64_t>();
    for (int64_t r = 0; r < num_requests; ++r) {
      TORCH_CHECK_VALUE(u[r] >= 0 && u[r] <= nk[r], "varlen_attention_cpu: seqused_k[", r, "] = ",
                        u[r], " outside [0, ", nk[r], "] (the request's cu_seqlens_k range)");
      nk[r] = u[r];
    }
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  switch (q.scalar_type()) {
    case at::kFloat:
      launch<float>(q, k, v, cu_q, cu_k, nk, scale, causal, window, out, lse);
      break;
    case at::kBFloat16:
      launch<c10::BFloat16>(q, k, v, cu_q, cu_k, nk, scale, causal, window, out, lse);
      break;
    case at::kHalf:
      launch<c10::Half>(q, k, v, cu_q, cu_k, nk, scale, causal, window, out, lse);
      break;
    default:
      TORCH_CHECK_VALUE(false, "varlen_attention_cpu: dtype must be float32, bfloat16 or "
                        "float16, got ", q.scalar_type());
  }
  return {out, lse};
}
