// Paged-cache attention and cache writes on CPU (see paged_attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

// q [T, Hq, D] (fp32/bf16/fp16); key_cache/value_cache [num_blocks, block_size, Hkv, D] of any
// strides with the last one 1 (read in place, in their own dtype); block_table [R, max_blocks],
// cu_seqlens_q [R + 1], seq_lens [R], kv_start/kv_end [T] (int32 or int64).
// Returns out [T, Hq, D] float32 and lse [T, Hq] float32.
std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
    double scale, const std::optional<at::Tensor>& kv_start,
    const std::optional<at::Tensor>& kv_end);

// key/value [T, Hkv, D] rows stored at slot_mapping [T] (-1: skipped) of caches
// [num_blocks, block_size, Hkv, D] (strided views, last stride 1), cast to the cache dtype.
void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& slot_mapping);

// reshape_and_cache_cpu(key, value, key_cache, value_cache, slot_mapping), then
// paged_attention_cpu(q, ...) over the written caches: one call for a decode layer.
std::tuple<at::Tensor, at::Tensor> cache_and_paged_attention_cpu(
    const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
    double scale, const std::optional<at::Tensor>& kv_start,
    const std::optional<at::Tensor>& kv_end);
