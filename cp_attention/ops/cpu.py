"""Fast CPU implementation of :class:`~cp_attention.ops.interface.AttentionOps`.

``varlen_attention``, ``paged_attention``, ``reshape_and_cache``, their fused
``cache_and_paged_attention`` and ``merge_attn_states`` (float32 partials) run the C++ kernels
of ``ops/csrc``, the torch operators ``torch.ops.cp_attention.*`` (built by ``cp-attn build``
or on first use, :mod:`cp_attention.ops.cpu_build`): the paged cache is read in place, in its
own dtype, with float32 accumulation. float64 inputs go to ``ReferenceOps`` (the oracle's
precision). Checks here are O(1) (shapes, dtypes); value checks are the caller's.
"""
from __future__ import annotations

import torch
from torch._ops import _OpNamespace

from cp_attention.ops.interface import AttentionOps, Mask
from cp_attention.ops.merge import merge_attn_states
from cp_attention.ops.reference import ReferenceOps

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuOps(AttentionOps):
    """C++ CPU kernels behind the op interface; ``ReferenceOps`` for what they do not cover."""

    name = "cpu"

    def __init__(self, kernels: _OpNamespace):
        """``kernels``: ``torch.ops.cp_attention`` (:func:`~cp_attention.ops.cpu_build.
        load_cpu_extension`)."""
        self._ext = kernels
        self._reference = ReferenceOps()

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal,
                         window=None, seqused_k=None):
        if q.dtype not in _KERNEL_DTYPES or not q.is_cpu:
            return self._reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    scale=scale, causal=causal, window=window,
                                                    seqused_k=seqused_k)
        mask = Mask(bool(causal), window)
        return self._ext.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale),
                                          mask.causal, mask.kernel_window, seqused_k)

    def paged_attention(self, q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                        *, scale, kv_start=None, kv_end=None):
        if not _kernel_reads(q, key_cache, value_cache):
            return self._reference.paged_attention(
                q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale=scale,
                kv_start=kv_start, kv_end=kv_end)
        return self._ext.paged_attention(q, key_cache, value_cache, block_table, cu_seqlens_q,
                                         seq_lens, float(scale), kv_start, kv_end)

    def cache_and_paged_attention(self, q, key, value, key_cache, value_cache, slot_mapping,
                                  block_table, cu_seqlens_q, seq_lens, *, scale, kv_start=None,
                                  kv_end=None):
        """The cache write and the paged call in one C++ call (a decode layer's whole work)."""
        if not _kernel_reads(q, key_cache, value_cache):
            return super().cache_and_paged_attention(
                q, key, value, key_cache, value_cache, slot_mapping, block_table, cu_seqlens_q,
                seq_lens, scale=scale, kv_start=kv_start, kv_end=kv_end)
        return self._ext.cache_and_paged_attention(q, key, value, key_cache, value_cache,
                                                   slot_mapping, block_table, cu_seqlens_q,
                                                   seq_lens, float(scale), kv_start, kv_end)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        """Works on strided views (e.g. vLLM's ``[blocks, heads, slots, 2 * D]`` cache)."""
        if not key.is_cpu or key_cache.stride(-1) != 1 or \
                value_cache.stride(-1) != 1:
            self._reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
            return
        self._ext.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b):
        if all(x.dtype == torch.float32 and x.is_cpu
               for x in (out_a, lse_a, out_b, lse_b)) and out_a.stride(-1) == 1 and \
                out_b.stride(-1) == 1:
            return self._ext.merge_attn_states(out_a, lse_a, out_b, lse_b)
        return merge_attn_states(out_a, lse_a, out_b, lse_b)


def _kernel_reads(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the C++ paged kernel takes these (CPU, its dtypes, head_size contiguous)."""
    return q.dtype in _KERNEL_DTYPES and key_cache.dtype in _KERNEL_DTYPES and \
        q.is_cpu and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
