"""Fast CPU implementation of :class:`~cp_attention.ops.interface.AttentionOps`.

``varlen_attention``, ``paged_attention``, ``reshape_and_cache``, their fused
``cache_and_paged_attention`` and ``merge_attn_states`` (float32 partials) run the C++ kernels
of ``ops/csrc``, the torch operators ``torch.ops.cp_attention.*`` (built by ``cp-attn build``
or on first use, :mod:`cp_attention.ops.cpu_build`): the paged cache is read in place, in its
own dtype, with float32 accumulation. What the kernels do not take (float64 inputs, the
oracle's precision; tensors off the CPU; a head_size dimension that is not contiguous) goes to
``ReferenceOps`` through :func:`~cp_attention.ops.interface.falls_back` (logged once per op and
reason; an error under ``CP_ATTENTION_STRICT_OPS``), the reason given by :func:`_refusal`.
Checks here are O(1) (shapes, dtypes); value checks are the caller's.
"""
from __future__ import annotations

import torch
from torch._ops import _OpNamespace

from cp_attention.ops.interface import AttentionOps, Mask, falls_back
from cp_attention.ops.merge import merge_attn_states
from cp_attention.ops.reference import ReferenceOps

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _refusal(dtypes: tuple[torch.dtype, ...] | None, typed: dict[str, torch.Tensor],
             rows: dict[str, torch.Tensor] | None = None) -> str | None:
    """Why the C++ kernels do not take a call, or None: each ``typed`` tensor must be a CPU
    tensor of ``dtypes`` (None: any), each ``rows`` tensor have a contiguous last dimension."""
    for name, x in typed.items():
        if not x.is_cpu:
            return f"{name} on {x.device.type}"
        if dtypes is not None and x.dtype not in dtypes:
            return f"{name} dtype {x.dtype}"
    for name, x in (rows or {}).items():
        if x.stride(-1) != 1:
            return f"{name} last-dim stride {x.stride(-1)}"
    return None


def _paged_refusal(q: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor) -> str | None:
    return _refusal(_KERNEL_DTYPES, {"q": q, "key_cache": key_cache},
                    {"key_cache": key_cache, "value_cache": value_cache})


class CpuOps(AttentionOps):
    """C++ CPU kernels behind the op interface; ``ReferenceOps`` for what they do not take."""

    name = "cpu"

    def __init__(self, kernels: _OpNamespace):
        """``kernels``: ``torch.ops.cp_attention`` (:func:`~cp_attention.ops.cpu_build.
        load_cpu_extension`)."""
        self._ext = kernels
        self._reference = ReferenceOps()

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal,
                         window=None, seqused_k=None):
        if falls_back("CpuOps.varlen_attention", _refusal(_KERNEL_DTYPES, {"q": q})):
            return self._reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    scale=scale, causal=causal, window=window,
                                                    seqused_k=seqused_k)
        mask = Mask(bool(causal), window)
        return self._ext.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale),
                                          mask.causal, mask.kernel_window, seqused_k)

    def paged_attention(self, q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                        *, scale, kv_start=None, kv_end=None):
        if falls_back("CpuOps.paged_attention", _paged_refusal(q, key_cache, value_cache)):
            return self._reference.paged_attention(
                q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale=scale,
                kv_start=kv_start, kv_end=kv_end)
        return self._ext.paged_attention(q, key_cache, value_cache, block_table, cu_seqlens_q,
                                         seq_lens, float(scale), kv_start, kv_end)

    def cache_and_paged_attention(self, q, key, value, key_cache, value_cache, slot_mapping,
                                  block_table, cu_seqlens_q, seq_lens, *, scale, kv_start=None,
                                  kv_end=None):
        """The cache write and the paged call in one C++ call (a decode layer's whole work)."""
        if falls_back("CpuOps.cache_and_paged_attention",
                      _paged_refusal(q, key_cache, value_cache)):
            self._reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
            return self._reference.paged_attention(
                q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale=scale,
                kv_start=kv_start, kv_end=kv_end)
        return self._ext.cache_and_paged_attention(q, key, value, key_cache, value_cache,
                                                   slot_mapping, block_table, cu_seqlens_q,
                                                   seq_lens, float(scale), kv_start, kv_end)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        """Works on strided views (e.g. vLLM's ``[blocks, heads, slots, 2 * D]`` cache)."""
        if falls_back("CpuOps.reshape_and_cache", _refusal(
                None, {"key": key}, {"key_cache": key_cache, "value_cache": value_cache})):
            self._reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
            return
        self._ext.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b):
        if falls_back("CpuOps.merge_attn_states", _refusal(
                (torch.float32,), {"out_a": out_a, "lse_a": lse_a, "out_b": out_b,
                                   "lse_b": lse_b}, {"out_a": out_a, "out_b": out_b})):
            return merge_attn_states(out_a, lse_a, out_b, lse_b)
        return self._ext.merge_attn_states(out_a, lse_a, out_b, lse_b)
