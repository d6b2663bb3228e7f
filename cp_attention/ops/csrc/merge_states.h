// Exact LSE merge of two partial attention results on CPU (see merge_states.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

// out_a/out_b [T, H, D] float32 (any strides, last one 1), lse_a/lse_b [T, H] float32.
// Returns out [T, H, D] float32 and lse [T, H] float32: the attention over the union of the
// two (disjoint) key sets; rows where both parts are empty (lse -inf) give 0 and -inf.
std::tuple<at::Tensor, at::Tensor> merge_attn_states_cpu(const at::Tensor& out_a,
                                                         const at::Tensor& lse_a,
                                                         const at::Tensor& out_b,
                                                         const at::Tensor& lse_b);
