// Causal / varlen prefill attention on CPU with log-sum-exp (flash-attention style tiles).
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

// q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] (Hq % Hkv == 0), float32 / bfloat16 / float16, any strides.
// cu_seqlens_q / cu_seqlens_k: [R + 1] int32 or int64 cumulative lengths.
// Bottom-right causal: in a request with nq queries and nk keys, query i sits at key position
// nk - nq + i and sees keys <= that position; window > 0 additionally hides keys <= pos - window
// (needs causal); window <= 0 means no window. Rows that see no key: out 0, lse -inf.
// seqused_k: optional [R] int32/int64; request r attends only the first seqused_k[r] keys of
// its cu_seqlens_k range (0 <= seqused_k[r] <= range), and nk = seqused_k[r] aligns the mask.
// Returns out [Tq, Hq, D] float32 and lse [Tq, Hq] float32 (natural log).
std::tuple<at::Tensor, at::Tensor> varlen_attention_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    double scale, bool causal, int64_t window, const std::optional<at::Tensor>& seqused_k);
