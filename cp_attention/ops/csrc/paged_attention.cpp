// Attention of packed queries over a paged KV cache, read in place (flash-decoding on CPU).
//
// Work item = (request, KV head, chunk of query tokens, range of keys). An item holds all
// query rows of its chunk that share the KV head (GQA group x tokens, one row per vector lane,
// 8 rows per lane group) and streams the keys of its range tile by tile straight from the
// cache blocks: each K/V row is read once per item, in the cache's dtype, converted to float32
// in a small L1 buffer (bf16/fp16) or used in place (fp32; bf16 K with bf16 queries on a CPU
// with avx512_bf16: bf16 dot products, no widening); the next tile's rows are
// prefetched meanwhile, head by head where an item has one row per KV head (decode does ~4
// flop per byte read: without the overlap the DRAM reads stall it about as long as it
// computes). Scores and probabilities are lane-parallel
// over the rows (a lane group of up to 4 rows gets its scores from dot products over d
// instead; an item of 1 to 4 rows per KV head, a decode with a GQA group of 1 to 4, keeps
// its scores and softmax with keys along the lanes, 8 keys per exp: run_item<.., kKeyRows>),
// the online softmax rescales the float32 accumulators, and long contexts are cut
// into several key ranges when threads would otherwise idle; those partials are merged by
// their LSE at the end. Items are handed out dynamically to at::get_num_threads() workers.
#include "paged_attention.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "attention_common.h"

namespace cp_attention {
namespace {

constexpr int kTileKeys = 32;          // keys per tile (never crosses a cache block)
constexpr int64_t kRowsPerItem = 64;   // query rows (tokens x group heads) per work item
constexpr int64_t kMinSplitKeys = 512;  // shortest key range worth its own work item
constexpr int64_t kMaxItemRows = 256;   // query rows of all KV heads of an item (scratch)
constexpr ScoreBase kBase = ScoreBase::kNatural;  // scores q . k * scale
constexpr int kKeyLaneRows = 4;  // items of at most this many rows per KV head: keys on lanes

// Reads entries of an int32 or int64 index tensor (1-D or 2-D) without converting it (vLLM
// passes int32; converting costs a share of a short decode: results/history.md section 15).
struct IndexTable {
  const void* data = nullptr;  // null: no tensor (at() must not be called)
  bool is_int32 = false;
  int64_t stride0 = 0, stride1 = 0;

  IndexTable() = default;
  explicit IndexTable(const at::Tensor& t)
      : data(t.data_ptr()), is_int32(t.scalar_type() == at::kInt),
        stride0(t.stride(0)), stride1(t.dim() > 1 ? t.stride(1) : 0) {}

  explicit operator bool() const { return data != nullptr; }

  int64_t at(int64_t i, int64_t j = 0) const {
    const int64_t k = i * stride0 + j * stride1;
    return is_int32 ? static_cast<const int32_t*>(data)[k] : static_cast<const int64_t*>(data)[k];
  }
};

struct PagedProblem {
  const float* q;  // [T, Hq, D] float32 contiguous
  const char* k_base;
  const char* v_base;
  int64_t elem_size;
  int64_t k_stride[3], v_stride[3];  // element strides of the block, slot and head dims
  IndexTable table;
  int64_t block_size, num_blocks;
  const int64_t* row_lo;  // [T] first visible key of each token (clipped)
  const int64_t* row_hi;  // [T] end of its visible keys
  int64_t num_q_heads, group, dim;
  float scale;
  bool bf16_dot;  // bf16 queries and cache, dim % 16 == 0, built with avx512_bf16: scores
                  // are bf16 dot products of the unscaled queries (qk_dots_bf16, qk_tile_bf16)
};

// KV heads [head, head + num_heads) of one request's query tokens [t0, t1) over keys
// [k0, k1). Several heads per item where the cache interleaves heads inside a slot (the
// [blocks, block_size, Hkv, D] layout): a tile then reads one contiguous span per key for all
// of them instead of one strided row per head and pass.
struct WorkItem {
  int64_t req, head, num_heads, t0, t1, k0, k1;
  int64_t part_row;  // first row in the partial buffers (the item's heads one after the
                     // other), or -1: write the output directly
};

// The key-range partials of one KV head's rows: split sp's row r at part_row + sp * stride + r.
struct MergeUnit {
  int64_t head, t0, t1, part_row, num_splits, split_stride;
};

// Per-thread buffers, grown to the largest item seen and kept between calls (thread_scratch):
// run_item initializes what an item reads.
struct Scratch {
  std::vector<float> q_t;   // [groups][D][8] queries, transposed, pre-scaled
  std::vector<float> q_rows;  // [groups * 8][D] the same queries, row-major (qk_dot)
  std::vector<uint16_t> q_bf16;  // [groups * 8][D] the queries as bf16 bits, not scaled
  std::vector<uint32_t> q_pairs;  // [groups][D / 2][8] the same, two per lane (qk_tile_bf16)
  std::vector<float> acc;   // [groups * 8][D]
  std::vector<float> k_buf, v_buf;  // [kTileKeys][D] converted K/V rows
  std::vector<vi8> lo, hi;  // [groups of one head] visible key range of each lane
  std::vector<int64_t> grp_lo, grp_hi;          // [groups of one head] union of lo / hi
  std::vector<int64_t> grp_all_lo, grp_all_hi;  // [groups of one head] keys all lanes see
  std::vector<SoftmaxState> state;  // [groups]
  vf8 scores[kTileKeys];
  alignas(32) float key_scores[kKeyLaneRows * kTileKeys];  // [row][key] (attend_key_lanes)

  // Grows the buffers for items of up to `groups` lane groups of head size `dim`.
  void fit(int64_t groups, int64_t dim) {
    const auto grow = [](auto& buffer, int64_t size) {
      if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    };
    grow(q_t, groups * dim * kLanes);
    grow(q_rows, groups * kLanes * dim);
    grow(q_bf16, groups * kLanes * dim);
    grow(q_pairs, groups * (dim / 2) * kLanes);
    grow(acc, groups * kLanes * dim);
    grow(k_buf, kTileKeys * dim);
    grow(v_buf, kTileKeys * dim);
    for (auto* v : {&grp_lo, &grp_hi, &grp_all_lo, &grp_all_hi}) grow(*v, groups);
    grow(lo, groups);
    grow(hi, groups);
    grow(state, groups);
  }
};

// This thread's Scratch, fitted to the call and kept between calls (allocating and zeroing
// fresh buffers in every call shows in short decodes: results/history.md section 15).
Scratch& thread_scratch(int64_t groups, int64_t dim) {
  thread_local Scratch scratch;
  scratch.fit(groups, dim);
  return scratch;
}

// Keys [t, t + n) of an item: at most kTileKeys, all in one cache block.
template <typename scalar_t>
struct Tile {
  const scalar_t* k = nullptr;  // first K row; rows are pb.k_stride[1] elements apart
  const scalar_t* v = nullptr;  // first V row
  int n = 0;                    // 0: no tile (t at the end, or a block id outside the cache)
};

template <typename scalar_t>
Tile<scalar_t> locate_tile(const PagedProblem& pb, const WorkItem& item, int64_t t,
                           int64_t k_end) {
  if (t >= k_end) return {};
  const int64_t bs = pb.block_size, offset = t % bs;
  const int64_t block = pb.table.at(item.req, t / bs);
  if (block < 0 || block >= pb.num_blocks) return {};
  Tile<scalar_t> tile;
  tile.k = reinterpret_cast<const scalar_t*>(pb.k_base) + block * pb.k_stride[0] +
           offset * pb.k_stride[1] + item.head * pb.k_stride[2];
  tile.v = reinterpret_cast<const scalar_t*>(pb.v_base) + block * pb.v_stride[0] +
           offset * pb.v_stride[1] + item.head * pb.v_stride[2];
  tile.n = static_cast<int>(std::min<int64_t>({kTileKeys, bs - offset, k_end - t}));
  return tile;
}

// The rows of KV head h (of the item's first + h) of a tile.
template <typename scalar_t>
Tile<scalar_t> head_rows(const PagedProblem& pb, Tile<scalar_t> tile, int64_t h) {
  tile.k += h * pb.k_stride[2];
  tile.v += h * pb.v_stride[2];
  return tile;
}

// The cache lines of `rows` equally strided rows, handed out one per step().
class RowLines {
 public:
  RowLines() = default;
  RowLines(const void* base, int64_t stride_bytes, int64_t row_bytes, int rows)
      : base_(static_cast<const char*>(base)), stride_(stride_bytes), row_bytes_(row_bytes),
        rows_(rows) {}

  CP_INLINE void step() {
    if (line_ >= row_end_) {  // this row is done: start the next one
      if (row_ == rows_) return;
      const char* start = base_ + row_++ * stride_;
      line_ = start - reinterpret_cast<uintptr_t>(start) % kLineBytes;
      row_end_ = start + row_bytes_;
    }
    __builtin_prefetch(line_, 0, 2);  // read, into L2
    line_ += kLineBytes;
  }

 private:
  static constexpr int64_t kLineBytes = 64;
  const char* base_ = nullptr;
  int64_t stride_ = 0, row_bytes_ = 0;
  int rows_ = 0, row_ = 0;
  const char* line_ = nullptr;     // next line to prefetch
  const char* row_end_ = nullptr;  // end of the current row
};

// Prefetches the next tile's K and V rows, one line (of K and of V in turn) per step(). The
// steps are spread over the current tile's score loop so that the DRAM reads overlap its
// arithmetic: the hardware prefetchers stop at every 4 KiB page (a cache block holds a few
// of them), and bursts of prefetches stall the core, so one line is prefetched per step.
// Lines go to L2, not L1 (prefetcht1): a tile of several KV heads (64 KiB of K and of V for
// 8 x 128 bf16) would evict the tile being computed from L1 (results/history.md section 15).
class TilePrefetcher {
 public:
  TilePrefetcher() = default;  // nothing to prefetch
  // Rows of `heads` KV heads from the tile's first: per key, the span from the first head's
  // row to the end of the last one's (contiguous where the cache interleaves heads).
  template <typename scalar_t>
  TilePrefetcher(const PagedProblem& pb, const Tile<scalar_t>& tile, int64_t heads)
      : k_(tile.k, pb.k_stride[1] * sizeof(scalar_t),
           ((heads - 1) * pb.k_stride[2] + pb.dim) * sizeof(scalar_t), tile.n),
        v_(tile.v, pb.v_stride[1] * sizeof(scalar_t),
           ((heads - 1) * pb.v_stride[2] + pb.dim) * sizeof(scalar_t), tile.n) {}

  CP_INLINE void step() {
    value_turn_ = !value_turn_;
    if (value_turn_) {
      v_.step();
    } else {
      k_.step();
    }
  }

 private:
  RowLines k_, v_;
  bool value_turn_ = true;  // K first
};

// scores[j] (lane i) = sum_d q_t[d][i] * K_j[d] for the n keys K_j = keys + j * key_stride.
// Steps `prefetch` once per d and key block (enough for a tile of its dtype's rows).
// kStride > 0: key_stride is kStride, so the 8 keys of a block are immediate offsets from one
// pointer (a runtime stride needs 8 pointers, which spill: results/history.md section 15).
template <int64_t kStride>
CP_INLINE void qk_tile_strided(const float* q_t, const float* keys, int64_t runtime_stride,
                               int n, int64_t dim, vf8* scores, TilePrefetcher& prefetch) {
  const int64_t key_stride = kStride > 0 ? kStride : runtime_stride;
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* k = keys + j * key_stride;
    vf8 a0 = splat(0.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < dim; ++d) {
      prefetch.step();
      const vf8 qv = load8(q_t + d * kLanes);
      a0 += qv * splat(k[d]);
      a1 += qv * splat(k[key_stride + d]);
      a2 += qv * splat(k[2 * key_stride + d]);
      a3 += qv * splat(k[3 * key_stride + d]);
      a4 += qv * splat(k[4 * key_stride + d]);
      a5 += qv * splat(k[5 * key_stride + d]);
      a6 += qv * splat(k[6 * key_stride + d]);
      a7 += qv * splat(k[7 * key_stride + d]);
    }
    scores[j] = a0, scores[j + 1] = a1, scores[j + 2] = a2, scores[j + 3] = a3;
    scores[j + 4] = a4, scores[j + 5] = a5, scores[j + 6] = a6, scores[j + 7] = a7;
  }
  for (; j + 2 <= n; j += 2) {
    const float* k = keys + j * key_stride;
    vf8 a0 = splat(0.f), a1 = a0, b0 = a0, b1 = a0;
    int64_t d = 0;
    for (; d + 2 <= dim; d += 2) {
      prefetch.step();
      const vf8 q0 = load8(q_t + d * kLanes), q1 = load8(q_t + (d + 1) * kLanes);
      a0 += q0 * splat(k[d]);
      b0 += q1 * splat(k[d + 1]);
      a1 += q0 * splat(k[key_stride + d]);
      b1 += q1 * splat(k[key_stride + d + 1]);
    }
    for (; d < dim; ++d) {
      const vf8 qv = load8(q_t + d * kLanes);
      a0 += qv * splat(k[d]);
      a1 += qv * splat(k[key_stride + d]);
    }
    scores[j] = a0 + b0, scores[j + 1] = a1 + b1;
  }
  for (; j < n; ++j) {
    const float* k = keys + j * key_stride;
    vf8 a0 = splat(0.f), a1 = a0;
    int64_t d = 0;
    for (; d + 2 <= dim; d += 2) {
      prefetch.step();
      a0 += load8(q_t + d * kLanes) * splat(k[d]);
      a1 += load8(q_t + (d + 1) * kLanes) * splat(k[d + 1]);
    }
    for (; d < dim; ++d) a0 += load8(q_t + d * kLanes) * splat(k[d]);
    scores[j] = a0 + a1;
  }
}

// qk_tile_strided with the key strides of the common layouts as constants: head sizes 64 and
// 128, one KV head per slot, or K and V packed in one row (vLLM's layout), or staged rows.
CP_INLINE void qk_tile(const float* q_t, const float* keys, int64_t key_stride, int n,
                       int64_t dim, vf8* scores, TilePrefetcher& prefetch) {
  switch (key_stride) {
    case 64: return qk_tile_strided<64>(q_t, keys, 0, n, dim, scores, prefetch);
    case 128: return qk_tile_strided<128>(q_t, keys, 0, n, dim, scores, prefetch);
    case 256: return qk_tile_strided<256>(q_t, keys, 0, n, dim, scores, prefetch);
    default: return qk_tile_strided<0>(q_t, keys, key_stride, n, dim, scores, prefetch);
  }
}

// Lane i of the result = the sum of the lanes of a[i] (a tree of in-lane shuffles and adds).
CP_INLINE vf8 reduce8(const vf8* a) {
  vf8 pairs[4];  // pairs[i]: partial sums of a[2i] and a[2i + 1], interleaved
  for (int i = 0; i < 4; ++i) {
    const vf8 lo = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    const vf8 hi = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    pairs[i] = lo + hi;
  }
  vf8 quads[2];  // lane 4h + k of quads[i]: the sum of half h of a[4i + k]
  for (int i = 0; i < 2; ++i) {
    const vf8 p0 = pairs[2 * i], p1 = pairs[2 * i + 1];
    const vf8 lo = __builtin_shufflevector(p0, p1, 0, 1, 8, 9, 4, 5, 12, 13);
    const vf8 hi = __builtin_shufflevector(p0, p1, 2, 3, 10, 11, 6, 7, 14, 15);
    quads[i] = lo + hi;
  }
  return __builtin_shufflevector(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Lane j * R + r = q_r . K_j for R rows (dim apart) and J keys, as dot products with lanes
// over d (head sizes not a multiple of 8 included); lanes past R * J are 0. Steps `prefetch`
// once per K vector it loads.
template <int R, int J, typename key_t>
CP_INLINE vf8 qk_dots(const float* q, const key_t* keys, int64_t key_stride, int64_t dim,
                      TilePrefetcher& prefetch) {
  static_assert(R * J <= kLanes, "one accumulator per (row, key), reduced by reduce8");
  vf8 acc[kLanes] = {};  // acc[j * R + r]; the ones past R * J stay 0
  const int64_t vec_end = dim - dim % kLanes;
  for (int64_t d = 0; d < vec_end; d += kLanes) {
    vf8 k[J];
    for (int j = 0; j < J; ++j) {
      prefetch.step();
      k[j] = load8(keys + j * key_stride + d);
    }
    for (int r = 0; r < R; ++r) {
      const vf8 qv = load8(q + r * dim + d);
      for (int j = 0; j < J; ++j) acc[j * R + r] += qv * k[j];
    }
  }
  vf8 dots = reduce8(acc);
  for (int64_t d = vec_end; d < dim; ++d)  // head sizes that are not a multiple of 8
    for (int j = 0; j < J; ++j)
      for (int r = 0; r < R; ++r)
        dots[j * R + r] += q[r * dim + d] * static_cast<float>(keys[j * key_stride + d]);
  return dots;
}

// scores[j][r] = q_r . K_j (qk_dots, lanes [jR, jR + R) moved to lanes [0, R) of scores[j] in
// registers); scores[j]'s other lanes get 0.
template <int R, int J, typename key_t>
CP_INLINE void qk_dot_block(const float* q, const key_t* keys, int64_t key_stride, int64_t dim,
                            vf8* scores, TilePrefetcher& prefetch) {
  const vf8 dots = qk_dots<R, J>(q, keys, key_stride, dim, prefetch);
  const vi8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int j = 0; j < J; ++j) {
    const vf8 row = __builtin_shuffle(dots, (lane + j * R) & 7);
    scores[j] = lane < R ? row : splat(0.f);
  }
}

template <int R, typename key_t>
CP_INLINE void qk_dot_rows(const float* q, const key_t* keys, int64_t key_stride, int n,
                           int64_t dim, vf8* scores, TilePrefetcher& prefetch) {
  constexpr int J = kLanes / R;
  int j = 0;
  for (; j + J <= n; j += J)
    qk_dot_block<R, J>(q, keys + j * key_stride, key_stride, dim, scores + j, prefetch);
  for (; j < n; ++j)
    qk_dot_block<R, 1>(q, keys + j * key_stride, key_stride, dim, scores + j, prefetch);
}

// The scores of a lane group with at most kDotRows rows, where qk_tile would leave half or
// more of its lanes idle: same result, lanes = rows. attend_tile calls it for the last lane
// group of an item with more than kKeyLaneRows rows per KV head (9 rows: a group of 8, then
// one of 1); items of at most kKeyLaneRows rows (decode with a GQA group of 1 to 4) do not
// come here, attend_key_lanes computes theirs.
// Keys are read in the cache's dtype (float32, or widened from 16 bits as they are loaded).
constexpr int kDotRows = 4;
template <typename key_t>
CP_INLINE void qk_dot(const float* q_rows, int rows, const key_t* keys, int64_t key_stride,
                      int n, int64_t dim, vf8* scores, TilePrefetcher& prefetch) {
  switch (rows) {
    case 1: return qk_dot_rows<1>(q_rows, keys, key_stride, n, dim, scores, prefetch);
    case 2: return qk_dot_rows<2>(q_rows, keys, key_stride, n, dim, scores, prefetch);
    case 3: return qk_dot_rows<3>(q_rows, keys, key_stride, n, dim, scores, prefetch);
    default: return qk_dot_rows<4>(q_rows, keys, key_stride, n, dim, scores, prefetch);
  }
}

// ---- bf16 dot products (CPUs with avx512_bf16: Zen 4, Sapphire Rapids) ------------------
// A bf16 query against a bf16 cache: vdpbf16ps multiplies pairs of bf16 exactly and adds them
// in float32, where the float32 path widens every K element first (two instructions per 8).
// The query is not pre-scaled (scale * q would be rounded to bf16): the scores are scaled.
// Where build and CPU allow it (CP_HAS_BF16_DOT, pb.bf16_dot; results/history.md section 15).
#if CP_HAS_BF16_DOT
// Lane j * R + r = q_r . K_j for R rows of bf16 bits and J bf16 keys: vdpbf16ps, two exact
// products per lane and instruction (no widening of K), dim % 16 == 0. Steps `prefetch` once
// per K vector (16 elements).
template <int R, int J>
CP_INLINE vf8 qk_dots_bf16(const uint16_t* q, const c10::BFloat16* keys, int64_t key_stride,
                           int64_t dim, TilePrefetcher& prefetch) {
  static_assert(R * J <= kLanes, "one accumulator per (row, key), reduced by reduce8");
  __m256 acc[kLanes];
  for (int i = 0; i < kLanes; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    __m256bh k[J];
    for (int j = 0; j < J; ++j) {
      prefetch.step();
      k[j] = (__m256bh)_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(keys + j * key_stride + d));
    }
    for (int r = 0; r < R; ++r) {
      const __m256bh qv = (__m256bh)_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(q + r * dim + d));
      for (int j = 0; j < J; ++j) acc[j * R + r] = _mm256_dpbf16_ps(acc[j * R + r], qv, k[j]);
    }
  }
  vf8 a[kLanes];
  std::memcpy(a, acc, sizeof(a));
  return reduce8(a);
}

// qk_tile with bf16 dot products: scores[j] (lane i) = scale * sum_p pair_p(q_i) . pair_p(K_j)
// for q pairs [dim / 2][8] (two bf16 of one row per 32-bit lane) and bf16 keys in place (each
// key pair broadcast from memory); steps `prefetch` once per pair and key block.
CP_INLINE void qk_tile_bf16(const uint32_t* q_pairs, const c10::BFloat16* keys,
                            int64_t key_stride, int n, int64_t dim, float scale, vf8* scores,
                            TilePrefetcher& prefetch) {
  const int64_t pairs = dim / 2;
  const auto pair_of = [&](int j, int64_t p) {  // K_j's elements 2p, 2p + 1 in every lane
    int32_t bits;
    std::memcpy(&bits, keys + j * key_stride + 2 * p, sizeof(bits));
    return (__m256bh)_mm256_set1_epi32(bits);
  };
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      prefetch.step();
      const __m256bh qv = (__m256bh)_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(q_pairs + p * kLanes));
      for (int i = 0; i < 8; ++i) a[i] = _mm256_dpbf16_ps(a[i], qv, pair_of(j + i, p));
    }
    for (int i = 0; i < 8; ++i) {
      std::memcpy(&scores[j + i], &a[i], sizeof(vf8));
      scores[j + i] *= splat(scale);
    }
  }
  for (; j < n; ++j) {
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      prefetch.step();
      const __m256bh qv = (__m256bh)_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(q_pairs + p * kLanes));
      a0 = _mm256_dpbf16_ps(a0, qv, pair_of(j, p));
    }
    std::memcpy(&scores[j], &a0, sizeof(vf8));
    scores[j] *= splat(scale);
  }
}
#endif

// An empty asm that takes the C vectors in registers: GCC otherwise folds a float32 load into
// each FMA that uses it, R loads of one V vector instead of one (a load-bound P.V;
// results/history.md section 15).
template <int C>
CP_INLINE void keep_in_registers(vf8* v) {
#if defined(__x86_64__)
  if constexpr (C == 1) {
    asm("" : "+x"(v[0]));
  } else if constexpr (C == 2) {
    asm("" : "+x"(v[0]), "+x"(v[1]));
  } else {
    static_assert(C == 4, "pv_rows runs 1, 2 or 4 column vectors");
    asm("" : "+x"(v[0]), "+x"(v[1]), "+x"(v[2]), "+x"(v[3]));
  }
#endif
}

// acc rows lane0 .. lane0 + R (columns [c0, c0 + 8 C)) += sum_j p[j][lane] * V_j: each V
// vector is loaded once for the R rows (R * C accumulators in registers).
template <int R, int C, typename value_t>
CP_INLINE void pv_rows(float* acc, int64_t dim, int lane0, const vf8* probs,
                       const value_t* values, int64_t value_stride, int n, int64_t c0) {
  vf8 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = load8(acc + (lane0 + r) * dim + c0 + c * kLanes);
  for (int j = 0; j < n; ++j) {
    const value_t* v = values + j * value_stride + c0;
    vf8 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load8(v + c * kLanes);
    keep_in_registers<C>(vv);
    for (int r = 0; r < R; ++r) {
      const vf8 p = splat(probs[j][lane0 + r]);
      for (int c = 0; c < C; ++c) a[r][c] += p * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store8(acc + (lane0 + r) * dim + c0 + c * kLanes, a[r][c]);
}

// pv_rows over the vectorized columns of R rows: C = 8 / R vectors per pass, then one.
template <int R, typename value_t>
CP_INLINE void pv_row_block(float* acc, int64_t dim, int lane0, const vf8* probs,
                            const value_t* values, int64_t value_stride, int n,
                            int64_t vec_end) {
  // (C = 4 for R = 3, 4 where AVX-512 gives 32 registers was slower: results/history.md section 15)
  constexpr int C = kLanes / R > 4 ? 4 : kLanes / R;
  int64_t c = 0;
  for (; c + C * kLanes <= vec_end; c += C * kLanes)
    pv_rows<R, C>(acc, dim, lane0, probs, values, value_stride, n, c);
  for (; c < vec_end; c += kLanes)
    pv_rows<R, 1>(acc, dim, lane0, probs, values, value_stride, n, c);
}

// acc rows of one lane group (rows lanes [0, rows)) += P^T V over the tile (V in the cache's
// dtype, or staged as float32), four rows per pass over V.
template <typename value_t>
CP_INLINE void pv_tile(float* acc, int rows, const vf8* probs, const value_t* values,
                       int64_t value_stride, int n, int64_t dim) {
  const int64_t vec_end = dim - dim % kLanes;
  int lane = 0;
  for (; lane + 4 <= rows; lane += 4)
    pv_row_block<4>(acc, dim, lane, probs, values, value_stride, n, vec_end);
  switch (rows - lane) {
    case 3: pv_row_block<3>(acc, dim, lane, probs, values, value_stride, n, vec_end); break;
    case 2: pv_row_block<2>(acc, dim, lane, probs, values, value_stride, n, vec_end); break;
    case 1: pv_row_block<1>(acc, dim, lane, probs, values, value_stride, n, vec_end); break;
    default: break;
  }
  if (vec_end < dim) {  // head sizes that are not a multiple of 8
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < n; ++j) {
        const float p = probs[j][r];
        const value_t* v = values + j * value_stride;
        for (int64_t d = vec_end; d < dim; ++d) acc[r * dim + d] += p * static_cast<float>(v[d]);
      }
  }
}

// Folds keys [t, t + n) of KV head `h` of the item into its lane groups' softmax state and
// accumulators. K/V rows are `key_stride` / `value_stride` elements apart; K is float32 (or
// bf16 with pb.bf16_dot), V float32.
template <typename key_t, typename value_t>
CP_INLINE void attend_tile(const PagedProblem& pb, Scratch& s, int64_t rows, int64_t groups,
                           int64_t h, int64_t t, int n, const key_t* keys, int64_t key_stride,
                           const value_t* values, int64_t value_stride,
                           TilePrefetcher& prefetch) {
  const int64_t dim = pb.dim;
  for (int64_t g = 0; g < groups; ++g) {
    if (s.grp_lo[g] >= t + n || s.grp_hi[g] <= t) continue;  // no lane sees this tile
    const int64_t slot = h * groups + g;
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, rows - g * kLanes));
    if (lanes <= kDotRows) {
      qk_dot(s.q_rows.data() + slot * kLanes * dim, lanes, keys, key_stride, n, dim, s.scores,
             prefetch);
    } else if constexpr (std::is_same_v<key_t, float>) {
      qk_tile(s.q_t.data() + slot * dim * kLanes, keys, key_stride, n, dim, s.scores,
              prefetch);
    } else {  // bf16 K in place (pb.bf16_dot), no widening
      qk_tile_bf16(s.q_pairs.data() + slot * (dim / 2) * kLanes, keys, key_stride, n, dim,
                   pb.scale, s.scores, prefetch);
    }
    if (!(s.grp_all_lo[g] <= t && s.grp_all_hi[g] >= t + n)) {  // some lane sees part of it
      for (int j = 0; j < n; ++j) {
        const vi8 pos = splat_i(static_cast<int32_t>(t + j));
        s.scores[j] = (pos >= s.lo[g]) & (pos < s.hi[g]) ? s.scores[j] : splat(kNegInf);
      }
    }
    const vf8 alpha =
        softmax_tile<kBase>(s.state[slot], reinterpret_cast<float*>(s.scores), kLanes, n);
    float* acc = s.acc.data() + slot * kLanes * dim;
    for (int lane = 0; lane < lanes; ++lane) {
      const float f = alpha[lane];
      if (f != 1.0f) {
        float* a = acc + lane * dim;
        for (int64_t d = 0; d < dim; ++d) a[d] *= f;
      }
    }
    pv_tile(acc, lanes, s.scores, values, value_stride, n, dim);
  }
}

// ---- items of at most kKeyLaneRows rows per KV head (decode, GQA group 1 to 4) -----------
// Their scores are computed and soft-maxed with keys along the lanes (8 keys per exp, where
// one lane per row would use 1 to 4 of each vector's 8 lanes; results/history.md section 15).

// The scores of R rows and J keys: float32 queries (pre-scaled) against K in its dtype
// (qk_dots), or bf16 query bits against a bf16 K, times `scale` (qk_dots_bf16).
template <int R, int J, typename query_t, typename key_t>
CP_INLINE vf8 qk_dots_of(const query_t* q, const key_t* keys, int64_t key_stride, int64_t dim,
                         float scale, TilePrefetcher& prefetch) {
  if constexpr (std::is_same_v<query_t, uint16_t>) {
#if CP_HAS_BF16_DOT
    return qk_dots_bf16<R, J>(q, keys, key_stride, dim, prefetch) * splat(scale);
#else
    static_assert(!std::is_same_v<query_t, uint16_t>, "bf16 dot products need avx512_bf16");
#endif
  } else {
    return qk_dots<R, J>(q, keys, key_stride, dim, prefetch);
  }
}

// out[r * kTileKeys + j] = q_r . K_j for R rows and J = 1 key (qk_dots_of; a tile's last keys
// past a multiple of 8).
template <int R, typename query_t, typename key_t>
CP_INLINE void qk_key_scalar(const query_t* q, const key_t* keys, int64_t key_stride,
                             int64_t dim, float scale, float* out, TilePrefetcher& prefetch) {
  const vf8 dots = qk_dots_of<R, 1>(q, keys, key_stride, dim, scale, prefetch);
  for (int r = 0; r < R; ++r) out[r * kTileKeys] = dots[r];
}

// Where lane k of row r's scores is in the blocks of qk_dots<R, J> side by side: key k is
// lane (k % J) * R + r of block k / J.
template <int R, int J, int r>
constexpr int key_lane(int k) { return (k / J) * kLanes + (k % J) * R + r; }

// Row r's scores of 8 keys along the lanes from the kLanes / J blocks `d` of qk_dots<R, J>
// (in-register shuffles: row vectors stored whole, so the softmax's vector loads are forwarded
// from the stores instead of gathering 8 scalar stores each; results/history.md section 15).
template <int R, int r>
CP_INLINE vf8 key_row(const vf8* d) {
  if constexpr (R == 1) {
    return d[0];
  } else if constexpr (R == 2) {  // 2 blocks of 4 keys
    constexpr int J = 4;
    return __builtin_shufflevector(d[0], d[1], key_lane<R, J, r>(0), key_lane<R, J, r>(1),
                                   key_lane<R, J, r>(2), key_lane<R, J, r>(3),
                                   key_lane<R, J, r>(4), key_lane<R, J, r>(5),
                                   key_lane<R, J, r>(6), key_lane<R, J, r>(7));
  } else {  // R = 3, 4: 4 blocks of 2 keys; keys 0-3 from d[0], d[1], keys 4-7 from d[2], d[3]
    constexpr int J = 2;
    const vf8 lo = __builtin_shufflevector(d[0], d[1], key_lane<R, J, r>(0),
                                           key_lane<R, J, r>(1), key_lane<R, J, r>(2),
                                           key_lane<R, J, r>(3), 0, 0, 0, 0);
    const vf8 hi = __builtin_shufflevector(d[2], d[3], key_lane<R, J, r>(0),
                                           key_lane<R, J, r>(1), key_lane<R, J, r>(2),
                                           key_lane<R, J, r>(3), 0, 0, 0, 0);
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
  }
}

template <int R, int r = 0>
CP_INLINE void store_key_rows(const vf8* d, float* out) {
  if constexpr (r < R) {
    store8(out + r * kTileKeys, key_row<R, r>(d));
    store_key_rows<R, r + 1>(d, out);
  }
}

// out[r * kTileKeys + j] = q_r . K_j for R rows and n <= kTileKeys keys, 8 keys at a time
// from kLanes / J blocks of J = 8 / R keys (R = 3: J = 2, two lanes of each block idle).
template <int R, typename query_t, typename key_t>
CP_INLINE void qk_key_rows(const query_t* q, const key_t* keys, int64_t key_stride, int n,
                           int64_t dim, float scale, float* out, TilePrefetcher& prefetch) {
  constexpr int J = kLanes / R, kBlocks = (kLanes + J - 1) / J;
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    vf8 d[kBlocks];
    for (int b = 0; b < kBlocks; ++b)
      d[b] = qk_dots_of<R, J>(q, keys + (j + b * J) * key_stride, key_stride, dim, scale,
                              prefetch);
    store_key_rows<R>(d, out + j);
  }
  for (; j < n; ++j)
    qk_key_scalar<R>(q, keys + j * key_stride, key_stride, dim, scale, out + j, prefetch);
}

// Every lane of the result = the max (the sum) of v's lanes: three in-register shuffles.
CP_INLINE vf8 all_lanes_max(vf8 v) {
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  return vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
}

CP_INLINE vf8 all_lanes_sum(vf8 v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
}

// softmax_tile for R rows of `vecs` vectors of scores with keys along the lanes (row r at
// scores + r * kTileKeys; -inf = masked): folds them into lanes [0, R) of `state`,
// overwrites them with the probabilities and returns each row's rescale factor in lane r.
// Row maxima and sums stay in vectors (no scalar reduction per row), and one exp gives the
// rescale factors of all rows.
template <int R>
CP_INLINE vf8 softmax_key_vecs(SoftmaxState& state, float* scores, int vecs) {
  const vi8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const vf8 m_old = state.m;
  vf8 m_new = m_old, ref_all = softmax_ref(m_old), total = splat(0.0f);
  for (int r = 0; r < R; ++r) {
    float* row = scores + r * kTileKeys;
    vf8 vm = load8(row);
    for (int v = 1; v < vecs; ++v) vm = vmax(vm, load8(row + v * kLanes));
    const vf8 m_row = vmax(splat(m_old[r]), all_lanes_max(vm));
    const vf8 ref = softmax_ref(m_row);
    vf8 sum = splat(0.0f);
    for (int v = 0; v < vecs; ++v) {
      const vf8 p = pow_base<kBase>(load8(row + v * kLanes) - ref);
      store8(row + v * kLanes, p);
      sum += p;
    }
    m_new = lane == r ? m_row : m_new;
    ref_all = lane == r ? ref : ref_all;
    total = lane == r ? all_lanes_sum(sum) : total;
  }
  const vf8 alpha = pow_base<kBase>(m_old - ref_all);
  state.l = state.l * alpha + total;
  state.m = m_new;
  return alpha;
}

// softmax_key_vecs over n <= kTileKeys keys (past n: masked); whole tiles unrolled.
template <int R>
CP_INLINE vf8 softmax_key_rows(SoftmaxState& state, float* scores, int n) {
  if (n == kTileKeys) return softmax_key_vecs<R>(state, scores, kTileKeys / kLanes);
  const int vecs = (n + kLanes - 1) / kLanes;
  if (n % kLanes) {
    const vi8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int r = 0; r < R; ++r) {
      float* last = scores + r * kTileKeys + (vecs - 1) * kLanes;
      store8(last, lane < n % kLanes ? load8(last) : splat(kNegInf));
    }
  }
  return softmax_key_vecs<R>(state, scores, vecs);
}

// acc rows [0, R) = alpha[r] * acc + sum_j p[r][j] V_j over the n keys of the tile
// (probabilities key-major: p + r * kTileKeys), 4 columns vectors per pass.
template <int R, int C, typename value_t>
CP_INLINE void pv_key_cols(float* acc, int64_t dim, const float* p, const float* alpha,
                           const value_t* values, int64_t value_stride, int n, int64_t c0) {
  vf8 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      a[r][c] = load8(acc + r * dim + c0 + c * kLanes) * splat(alpha[r]);
  for (int j = 0; j < n; ++j) {
    const value_t* v = values + j * value_stride + c0;
    vf8 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load8(v + c * kLanes);
    keep_in_registers<C>(vv);
    for (int r = 0; r < R; ++r) {
      const vf8 pr = splat(p[r * kTileKeys + j]);
      for (int c = 0; c < C; ++c) a[r][c] += pr * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store8(acc + r * dim + c0 + c * kLanes, a[r][c]);
}

template <int R, typename value_t>
CP_INLINE void pv_key_rows(float* acc, int64_t dim, const float* p, const float* alpha,
                           const value_t* values, int64_t value_stride, int n) {
  const int64_t vec_end = dim - dim % kLanes;
  int64_t c = 0;
  constexpr int C = R <= 2 ? 4 : 2;  // R * C accumulators
  for (; c + C * kLanes <= vec_end; c += C * kLanes)
    pv_key_cols<R, C>(acc, dim, p, alpha, values, value_stride, n, c);
  for (; c < vec_end; c += kLanes)
    pv_key_cols<R, 1>(acc, dim, p, alpha, values, value_stride, n, c);
  for (int r = 0; r < R; ++r)  // head sizes that are not a multiple of 8
    for (int64_t d = vec_end; d < dim; ++d) {
      float x = acc[r * dim + d] * alpha[r];
      for (int j = 0; j < n; ++j)
        x += p[r * kTileKeys + j] * static_cast<float>(values[j * value_stride + d]);
      acc[r * dim + d] = x;
    }
}

// attend_tile for an item of R <= kKeyLaneRows rows per KV head (one lane group, g = 0).
template <int R, typename kv_t>
CP_INLINE void attend_key_lanes(const PagedProblem& pb, Scratch& s, int64_t h, int64_t t, int n,
                                const kv_t* keys, int64_t key_stride, const kv_t* values,
                                int64_t value_stride, TilePrefetcher& prefetch) {
  if (s.grp_lo[0] >= t + n || s.grp_hi[0] <= t) return;  // no row sees this tile
  const int64_t dim = pb.dim;
  if constexpr (kHasBF16Dot && std::is_same_v<kv_t, c10::BFloat16>) {
    if (pb.bf16_dot) {
      qk_key_rows<R>(s.q_bf16.data() + h * kLanes * dim, keys, key_stride, n, dim, pb.scale,
                     s.key_scores, prefetch);
    } else {
      qk_key_rows<R>(s.q_rows.data() + h * kLanes * dim, keys, key_stride, n, dim, 1.0f,
                     s.key_scores, prefetch);
    }
  } else {
    qk_key_rows<R>(s.q_rows.data() + h * kLanes * dim, keys, key_stride, n, dim, 1.0f,
                   s.key_scores, prefetch);
  }
  if (!(s.grp_all_lo[0] <= t && s.grp_all_hi[0] >= t + n)) {  // a row sees part of the tile
    const vi8 key = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < n; j += kLanes) {
        const vi8 pos = key + splat_i(static_cast<int32_t>(t + j));
        float* sc = s.key_scores + r * kTileKeys + j;
        store8(sc, (pos >= splat_i(s.lo[0][r])) & (pos < splat_i(s.hi[0][r])) ? load8(sc)
                                                                         : splat(kNegInf));
      }
  }
  float alpha[kLanes];
  store8(alpha, softmax_key_rows<R>(s.state[h], s.key_scores, n));
  pv_key_rows<R>(s.acc.data() + h * kLanes * dim, dim, s.key_scores, alpha, values,
                 value_stride, n);
}

// Not inlined into the work queue's loop, where the fp32 decode ran slower
// (results/history.md section 15).
// kKeyRows: the item's rows per KV head when they are at most kKeyLaneRows
// (attend_key_lanes), else 0 (attend_tile: lane groups of one row per lane).
template <typename scalar_t, int kKeyRows>
__attribute__((noinline)) void run_item(const PagedProblem& pb, const WorkItem& item,
                                        Scratch& s, float* out, float* lse, float* part_out,
                                        float* part_lse, std::atomic<bool>& bad_block) {
  const int64_t dim = pb.dim, group = pb.group, heads = item.num_heads;
  const int64_t tokens = item.t1 - item.t0;
  const int64_t rows = tokens * group;  // query rows of one KV head
  const int64_t groups = (rows + kLanes - 1) / kLanes;  // lane groups of one KV head
  // Lane group g of the item's head h is slot h * groups + g of q_t, q_rows, acc and state;
  // a row's key range depends on its token only, so lo/hi and the group ranges are per g.

  // Stage queries (transposed per lane group, pre-scaled) and each row's key range.
  std::fill(s.q_t.begin(), s.q_t.begin() + heads * groups * dim * kLanes, 0.f);
  if (pb.bf16_dot)
    std::fill(s.q_pairs.begin(), s.q_pairs.begin() + heads * groups * (dim / 2) * kLanes, 0u);
  std::fill(s.acc.begin(), s.acc.begin() + heads * groups * kLanes * dim, 0.f);
  int64_t k_begin = item.k1, k_end = item.k0;
  for (int64_t g = 0; g < groups; ++g) {
    int32_t lo[kLanes], hi[kLanes];
    int64_t min_lo = item.k1, max_hi = item.k0, max_lo = item.k0, min_hi = item.k1;
    for (int lane = 0; lane < kLanes; ++lane) {
      const int64_t r = g * kLanes + lane;
      if (r >= rows) {
        lo[lane] = hi[lane] = 0;  // padding lane: never visible, never written
        continue;
      }
      const int64_t t = item.t0 + r / group;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t q_head = (item.head + h) * group + r % group;
        const float* qrow = pb.q + (t * pb.num_q_heads + q_head) * dim;
        float* qt = s.q_t.data() + (h * groups + g) * dim * kLanes + lane;
        float* qr = s.q_rows.data() + (h * groups * kLanes + r) * dim;
        for (int64_t d = 0; d < dim; ++d) qr[d] = qt[d * kLanes] = qrow[d] * pb.scale;
        if (pb.bf16_dot) {  // the bits of bf16 values held as float32: exact
          uint16_t* qb = s.q_bf16.data() + (h * groups * kLanes + r) * dim;
          uint32_t* qp = s.q_pairs.data() + (h * groups + g) * (dim / 2) * kLanes + lane;
          for (int64_t d = 0; d < dim; ++d) {
            uint32_t bits;
            std::memcpy(&bits, qrow + d, sizeof(bits));
            qb[d] = static_cast<uint16_t>(bits >> 16);
          }
          for (int64_t p = 0; p < dim / 2; ++p)
            qp[p * kLanes] = static_cast<uint32_t>(qb[2 * p]) |
                             static_cast<uint32_t>(qb[2 * p + 1]) << 16;
        }
      }
      const int64_t a = std::max(pb.row_lo[t], item.k0), b = std::min(pb.row_hi[t], item.k1);
      lo[lane] = static_cast<int32_t>(a);
      hi[lane] = static_cast<int32_t>(b);
      if (a < b) {
        min_lo = std::min(min_lo, a);
        max_hi = std::max(max_hi, b);
      }
      max_lo = std::max(max_lo, a);
      min_hi = std::min(min_hi, b);
    }
    std::memcpy(&s.lo[g], lo, sizeof(lo));
    std::memcpy(&s.hi[g], hi, sizeof(hi));
    s.grp_lo[g] = min_lo, s.grp_hi[g] = max_hi;          // union of the lanes' ranges
    s.grp_all_lo[g] = max_lo, s.grp_all_hi[g] = min_hi;  // keys every lane sees
    k_begin = std::min(k_begin, min_lo);
    k_end = std::max(k_end, max_hi);
  }
  std::fill(s.state.begin(), s.state.begin() + heads * groups, SoftmaxState());

  // Items of up to kKeyLaneRows rows read 16-bit K/V in place (attend_key_lanes widens each
  // element as it loads it); wider items widen the tile's rows once into k_buf / v_buf (K
  // stays in place with bf16 dot products).
  Tile<scalar_t> tile = locate_tile<scalar_t>(pb, item, k_begin, k_end);
  for (int64_t t = k_begin; t < k_end;) {
    if (tile.n == 0) {
      bad_block.store(true);
      return;
    }
    const int n = tile.n;
    const scalar_t* k_tile = tile.k;
    const scalar_t* v_tile = tile.v;
    tile = locate_tile<scalar_t>(pb, item, t + n, k_end);
    TilePrefetcher prefetch(pb, tile, heads);
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* k_src = k_tile + h * pb.k_stride[2];
      const scalar_t* v_src = v_tile + h * pb.v_stride[2];
      if constexpr (kKeyRows == 1) {
        // One row per KV head (MHA decode) does the least arithmetic per byte: the span of
        // all heads per key, prefetched key by key, reaches the next tile's first heads too
        // late. Head h's turn prefetches the next tile's rows of head h, in the order they
        // are read; GQA items, where the span order was faster, keep it (results/history.md
        // section 15).
        if (heads > 1 && tile.n > 0) prefetch = TilePrefetcher(pb, head_rows(pb, tile, h), 1);
      }
      if constexpr (kKeyRows > 0) {
        attend_key_lanes<kKeyRows>(pb, s, h, t, n, k_src, pb.k_stride[1], v_src,
                                   pb.v_stride[1], prefetch);
      } else if constexpr (std::is_same_v<scalar_t, float>) {
        attend_tile(pb, s, rows, groups, h, t, n, k_src, pb.k_stride[1], v_src,
                    pb.v_stride[1], prefetch);
      } else {
        for (int j = 0; j < n; ++j)
          to_float(v_src + j * pb.v_stride[1], s.v_buf.data() + j * dim, dim);
        if constexpr (kHasBF16Dot && std::is_same_v<scalar_t, c10::BFloat16>) {
          if (pb.bf16_dot) {
            attend_tile(pb, s, rows, groups, h, t, n, k_src, pb.k_stride[1], s.v_buf.data(),
                        dim, prefetch);
            continue;
          }
        }
        for (int j = 0; j < n; ++j)
          to_float(k_src + j * pb.k_stride[1], s.k_buf.data() + j * dim, dim);
        attend_tile(pb, s, rows, groups, h, t, n, s.k_buf.data(), dim, s.v_buf.data(), dim,
                    prefetch);
      }
    }
    t += n;
  }

  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t slot = h * groups + r / kLanes, lane = r % kLanes;
      const float m = s.state[slot].m[lane], l = s.state[slot].l[lane];
      const float* acc = s.acc.data() + (h * groups * kLanes + r) * dim;
      if (item.part_row < 0) {
        const int64_t t = item.t0 + r / group;
        const int64_t q_head = (item.head + h) * group + r % group;
        const int64_t o = t * pb.num_q_heads + q_head;
        finalize_row<kBase>(acc, m, l, dim, out + o * dim, lse + o);
      } else {
        const int64_t o = item.part_row + h * rows + r;
        finalize_row<kBase>(acc, m, l, dim, part_out + o * dim, part_lse + o);
      }
    }
  }
}

// Merges the key-range partials of one (tokens, KV head) unit into the output rows.
void merge_unit(const MergeUnit& u, int64_t group, int64_t num_q_heads, int64_t dim,
                const float* part_out, const float* part_lse, float* out, float* lse) {
  const int64_t rows = (u.t1 - u.t0) * group;
  std::vector<float> weights(u.num_splits);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = (u.t0 + r / group) * num_q_heads + u.head * group + r % group;
    lse[o] = merge_weights(part_lse + u.part_row + r, u.split_stride, u.num_splits,
                           weights.data());
    float* dst = out + o * dim;
    std::memset(dst, 0, dim * sizeof(float));
    for (int64_t sp = 0; sp < u.num_splits; ++sp) {
      const float w = weights[sp];
      if (w == 0.f) continue;
      const float* src = part_out + (u.part_row + sp * u.split_stride + r) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += w * src[d];
    }
  }
}

// The two caches of paged_attention_cpu / reshape_and_cache_cpu: one 4-D shape and dtype,
// head_size contiguous (the other strides are free: the vLLM plugin's views).
void check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
                    "key_cache/value_cache must be [num_blocks, block_size, Hkv, D] of one "
                    "shape, got ", key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK_VALUE(key_cache.scalar_type() == value_cache.scalar_type(),
                    "key_cache and value_cache dtypes differ");
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
                    "the caches' head_size dimension must be contiguous");
}

// The sizes of a paged_attention_cpu call.
struct PagedShape {
  int64_t num_tokens, num_q_heads, dim, num_blocks, block_size, num_kv_heads, num_reqs;
};

// The O(1) checks of paged_attention_cpu's arguments (shapes, dtypes, devices).
PagedShape check_paged(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_table,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                       const std::optional<at::Tensor>& kv_start,
                       const std::optional<at::Tensor>& kv_end) {
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [T, Hq, D], got ", q.sizes());
  check_cache_pair(key_cache, value_cache);
  TORCH_CHECK_VALUE(q.device().is_cpu() && key_cache.device().is_cpu() &&
                    value_cache.device().is_cpu(), "paged_attention_cpu takes CPU tensors");
  const PagedShape shape{q.size(0), q.size(1), q.size(2), key_cache.size(0),
                         key_cache.size(1), key_cache.size(2), block_table.size(0)};
  TORCH_CHECK_VALUE(key_cache.size(3) == shape.dim, "head_size of q (", shape.dim,
                    ") != head_size of key_cache (", key_cache.size(3), ")");
  TORCH_CHECK_VALUE(shape.num_kv_heads >= 1 && shape.num_q_heads % shape.num_kv_heads == 0,
                    "q heads (", shape.num_q_heads, ") must be a multiple of key_cache heads (",
                    shape.num_kv_heads, ")");
  TORCH_CHECK_VALUE(block_table.dim() == 2 && (block_table.scalar_type() == at::kInt ||
                    block_table.scalar_type() == at::kLong),
                    "block_table must be a 2-D int32/int64 tensor");
  TORCH_CHECK_VALUE(cu_seqlens_q.numel() == shape.num_reqs + 1 &&
                    seq_lens.numel() == shape.num_reqs,
                    "block_table has ", shape.num_reqs, " rows, cu_seqlens_q ",
                    cu_seqlens_q.numel() - 1, " requests, seq_lens ", seq_lens.numel());
  const auto kv_dtype = key_cache.scalar_type();
  TORCH_CHECK_VALUE(kv_dtype == at::kFloat || kv_dtype == at::kBFloat16 || kv_dtype == at::kHalf,
                    "paged_attention_cpu takes float32/bfloat16/float16 caches, got ", kv_dtype);
  for (const auto* range : {&kv_start, &kv_end}) {
    if (range->has_value()) {
      TORCH_CHECK_VALUE((*range)->numel() == shape.num_tokens, "kv_start/kv_end need one entry "
                        "per query token (", shape.num_tokens, "), got ", (*range)->numel());
    }
  }
  return shape;
}

// The work of one call: each token's visible key range, the work items and the merges of
// split key ranges.
struct PagedPlan {
  std::vector<int64_t> row_lo, row_hi;  // [T] visible keys of each token, clipped to seq_len
  std::vector<WorkItem> items;
  std::vector<MergeUnit> merges;
  int64_t part_rows = 0;   // rows of the partial buffers
  int64_t max_groups = 1;  // lane groups of the largest item (scratch size)
};

// Plans the items (checking the values of cu_seqlens_q and seq_lens): query tokens in chunks
// of kRowsPerItem rows; KV heads together where the cache interleaves them; key ranges split
// so that every thread gets work.
PagedPlan plan_paged(const PagedShape& shape, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, int64_t max_blocks_per_req,
                     const IndexTable& cu, const IndexTable& len, const IndexTable& start,
                     const IndexTable& end) {
  const int64_t num_tokens = shape.num_tokens, num_kv_heads = shape.num_kv_heads;
  PagedPlan plan;
  plan.row_lo.assign(num_tokens, 0);
  plan.row_hi.assign(num_tokens, 0);
  const int64_t group = shape.num_q_heads / num_kv_heads;
  const int64_t tokens_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  struct Unit { int64_t req, t0, t1, k0, k1; };
  std::vector<Unit> units;
  int64_t total_keys = 0;
  for (int64_t r = 0; r < shape.num_reqs; ++r) {
    const int64_t qs = cu.at(r), qe = cu.at(r + 1), seq_len = len.at(r);
    TORCH_CHECK_VALUE(0 <= qs && qs <= qe && qe <= num_tokens, "cu_seqlens_q[", r, ":", r + 2,
                      "] = [", qs, ", ", qe, "] is not a range of the ", num_tokens, " query rows");
    TORCH_CHECK_VALUE(0 <= seq_len && seq_len <= max_blocks_per_req * shape.block_size,
                      "seq_lens[", r, "] = ", seq_len, " does not fit ", max_blocks_per_req,
                      " blocks of ", shape.block_size);
    for (int64_t t = qs; t < qe; ++t) {
      plan.row_lo[t] = start ? std::clamp<int64_t>(start.at(t), 0, seq_len) : 0;
      plan.row_hi[t] = end ? std::clamp<int64_t>(end.at(t), 0, seq_len) : seq_len;
    }
    for (int64_t t0 = qs; t0 < qe; t0 += tokens_per_item) {
      const int64_t t1 = std::min(qe, t0 + tokens_per_item);
      int64_t k0 = seq_len, k1 = 0;
      for (int64_t t = t0; t < t1; ++t) {
        if (plan.row_lo[t] < plan.row_hi[t]) {
          k0 = std::min(k0, plan.row_lo[t]);
          k1 = std::max(k1, plan.row_hi[t]);
        }
      }
      if (k0 >= k1) continue;  // rows stay 0 / -inf
      units.push_back({r, t0, t1, k0, k1});
      total_keys += (k1 - k0) * num_kv_heads;
    }
  }

  // Heads per item: all the KV heads whose rows share a cache line span per key (the cache
  // interleaves heads inside a slot) up to kMaxItemRows rows, else one.
  const bool heads_interleaved = num_kv_heads > 1 &&
      key_cache.stride(2) < key_cache.stride(1) && value_cache.stride(2) < value_cache.stride(1);
  const int64_t threads = at::get_num_threads();
  const int64_t split_keys = threads > 1
      ? std::max<int64_t>(kMinSplitKeys, (total_keys + 4 * threads - 1) / (4 * threads))
      : std::numeric_limits<int64_t>::max();
  for (const Unit& u : units) {
    const int64_t rows = (u.t1 - u.t0) * group;
    const int64_t heads = heads_interleaved
        ? std::clamp<int64_t>(kMaxItemRows / rows, 1, num_kv_heads) : 1;
    const int64_t keys = u.k1 - u.k0;
    const int64_t splits = std::max<int64_t>(1, (keys * heads + split_keys - 1) / split_keys);
    const int64_t chunk = (keys + splits - 1) / splits;
    for (int64_t h0 = 0; h0 < num_kv_heads; h0 += heads) {
      const int64_t nh = std::min(heads, num_kv_heads - h0);
      plan.max_groups = std::max(plan.max_groups, nh * ((rows + kLanes - 1) / kLanes));
      if (splits == 1) {
        plan.items.push_back({u.req, h0, nh, u.t0, u.t1, u.k0, u.k1, -1});
        continue;
      }
      for (int64_t h = 0; h < nh; ++h)
        plan.merges.push_back({h0 + h, u.t0, u.t1, plan.part_rows + h * rows, splits, nh * rows});
      for (int64_t sp = 0; sp < splits; ++sp) {
        plan.items.push_back({u.req, h0, nh, u.t0, u.t1, u.k0 + sp * chunk,
                              std::min(u.k1, u.k0 + (sp + 1) * chunk), plan.part_rows});
        plan.part_rows += nh * rows;
      }
    }
  }
  return plan;
}

// Runs the plan's items on the caches' dtype, then the merges; out/lse [T, Hq(, D)] float32.
void run_paged(const PagedProblem& pb, const PagedPlan& plan, at::ScalarType kv_dtype,
               float* out, float* lse) {
  std::vector<float> part_out(plan.part_rows * pb.dim), part_lse(plan.part_rows);
  std::atomic<bool> bad_block{false};
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  const auto run_all = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    run_queue(num_items, [&]() -> Scratch& { return thread_scratch(plan.max_groups, pb.dim); },
              [&](int64_t i, Scratch& s) {
                const WorkItem& item = plan.items[i];
                const int64_t rows = (item.t1 - item.t0) * pb.group;  // per KV head
                auto run = rows == 1   ? run_item<scalar_t, 1>
                           : rows == 2 ? run_item<scalar_t, 2>
                           : rows == 3 ? run_item<scalar_t, 3>
                           : rows == 4 ? run_item<scalar_t, 4>
                                       : run_item<scalar_t, 0>;
                run(pb, item, s, out, lse, part_out.data(), part_lse.data(), bad_block);
              });
  };
  if (kv_dtype == at::kFloat) {
    run_all(float{});
  } else if (kv_dtype == at::kBFloat16) {
    run_all(c10::BFloat16{});
  } else {
    run_all(c10::Half{});
  }
  TORCH_CHECK_INDEX(!bad_block.load(), "block_table holds a block id outside [0, ",
                    pb.num_blocks, ")");
  run_queue(static_cast<int64_t>(plan.merges.size()), [] { return 0; }, [&](int64_t i, int) {
    merge_unit(plan.merges[i], pb.group, pb.num_q_heads, pb.dim, part_out.data(),
               part_lse.data(), out, lse);
  });
}

}  // namespace
}  // namespace cp_attention

using namespace cp_attention;

std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(
    const at::Tensor& q_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q_in,
    const at::Tensor& seq_lens_in, double scale, const std::optional<at::Tensor>& kv_start,
    const std::optional<at::Tensor>& kv_end) {
  const PagedShape shape = check_paged(q_in, key_cache, value_cache, block_table,
                                       cu_seqlens_q_in, seq_lens_in, kv_start, kv_end);
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({shape.num_tokens, shape.num_q_heads, shape.dim}, q.options());
  at::Tensor lse = at::full({shape.num_tokens, shape.num_q_heads}, kNegInf, q.options());
  if (shape.num_tokens == 0 || shape.num_reqs == 0) return {out, lse};

  // 1-D int32 and int64 are read in place (strided); others are flattened and converted.
  const auto as_index = [](const at::Tensor& t) {
    const at::Tensor flat = t.dim() == 1 ? t : t.reshape(-1);
    const auto dtype = flat.scalar_type();
    return dtype == at::kInt || dtype == at::kLong ? flat : flat.to(at::kLong);
  };
  const at::Tensor cu_q = as_index(cu_seqlens_q_in), lens = as_index(seq_lens_in);
  std::optional<at::Tensor> start, end;
  if (kv_start.has_value()) start = as_index(*kv_start);
  if (kv_end.has_value()) end = as_index(*kv_end);
  const PagedPlan plan = plan_paged(
      shape, key_cache, value_cache, block_table.size(1), IndexTable(cu_q), IndexTable(lens),
      start ? IndexTable(*start) : IndexTable(), end ? IndexTable(*end) : IndexTable());
  const PagedProblem pb{
      q.data_ptr<float>(),
      static_cast<const char*>(key_cache.data_ptr()),
      static_cast<const char*>(value_cache.data_ptr()),
      key_cache.element_size(),
      {key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)},
      {value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)},
      IndexTable(block_table),
      shape.block_size,
      shape.num_blocks,
      plan.row_lo.data(),
      plan.row_hi.data(),
      shape.num_q_heads,
      shape.num_q_heads / shape.num_kv_heads,
      shape.dim,
      static_cast<float>(scale),
      kHasBF16Dot && q_in.scalar_type() == at::kBFloat16 &&
          key_cache.scalar_type() == at::kBFloat16 && shape.dim % 16 == 0};
  run_paged(pb, plan, key_cache.scalar_type(), out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

void reshape_and_cache_cpu(const at::Tensor& key_in, const at::Tensor& value_in,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& slot_mapping_in) {
  check_cache_pair(key_cache, value_cache);
  const int64_t num_tokens = key_in.size(0);
  TORCH_CHECK_VALUE(key_in.dim() == 3 && value_in.sizes() == key_in.sizes() &&
                    key_in.size(1) == key_cache.size(2) && key_in.size(2) == key_cache.size(3),
                    "key/value must be [T, Hkv, D] matching the cache, got ", key_in.sizes(),
                    ", ", value_in.sizes(), " for a cache ", key_cache.sizes());
  TORCH_CHECK_VALUE(slot_mapping_in.dim() == 1 && slot_mapping_in.numel() == num_tokens &&
                    !at::isFloatingType(slot_mapping_in.scalar_type()),
                    "slot_mapping must be [T] integers, got ", slot_mapping_in.sizes());
  // Rows are copied from their strides: the restored step K/V of a PCP prefill are views of
  // one [T, 2, Hkv, D] tensor (a contiguous copy of each cost as much as the write).
  const auto rows_of = [](const at::Tensor& x, at::ScalarType dtype) {
    const at::Tensor y = x.to(dtype);
    return y.stride(2) == 1 ? y : y.contiguous();
  };
  const at::Tensor key = rows_of(key_in, key_cache.scalar_type());
  const at::Tensor value = rows_of(value_in, value_cache.scalar_type());
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t heads = key_cache.size(2), dim = key_cache.size(3);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t elem = key_cache.element_size();
  const int64_t row_bytes = dim * elem;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(key_cache.data_ptr());
  char* v_dst = static_cast<char*>(value_cache.data_ptr());
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::atomic<bool> bad_slot{false};
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slot[t];
      if (s < 0) continue;
      if (s >= num_slots) {
        bad_slot.store(true);
        continue;
      }
      const int64_t block = s / block_size, offset = s % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(k_dst + (block * key_cache.stride(0) + offset * key_cache.stride(1) +
                             h * key_cache.stride(2)) * elem,
                    k_src + (t * key.stride(0) + h * key.stride(1)) * elem, row_bytes);
        std::memcpy(v_dst + (block * value_cache.stride(0) + offset * value_cache.stride(1) +
                             h * value_cache.stride(2)) * elem,
                    v_src + (t * value.stride(0) + h * value.stride(1)) * elem, row_bytes);
      }
    }
  });
  TORCH_CHECK_INDEX(!bad_slot.load(), "slot_mapping holds a slot outside [-1, ", num_slots, ")");
}

std::tuple<at::Tensor, at::Tensor> cache_and_paged_attention_cpu(
    const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
    double scale, const std::optional<at::Tensor>& kv_start,
    const std::optional<at::Tensor>& kv_end) {
  reshape_and_cache_cpu(key, value, key_cache, value_cache, slot_mapping);
  return paged_attention_cpu(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                             scale, kv_start, kv_end);
}
