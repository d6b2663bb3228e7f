"""CUDA implementation of :class:`~cp_attention.ops.interface.AttentionOps`.

* ``varlen_attention``: ``flash_attn.flash_attn_varlen_func(..., return_attn_probs=True)``
  for float16/bfloat16 when flash-attn imports (``seqused_k`` passed through where the
  function takes it, else the used key prefixes are packed); otherwise explicit
  matmul-softmax math per request (any device, any float dtype: also what runs on CPU in the
  tests), a fallback (:func:`~cp_attention.ops.interface.falls_back`) unless asked for with
  ``use_flash=False``;
* ``paged_attention``: the request/row plan of :func:`cp_attention.ops.paged_plan.plan_paged`,
  keys gathered from the cache into packed varlen K/V, then the varlen path (flash-attn's own
  paged mode needs page sizes that are multiples of 256, so it is not used);
* ``reshape_and_cache`` / ``merge_attn_states``: vectorised torch (index_copy_, LSE merge).
Argument conventions live in :mod:`cp_attention.ops.cuda_args`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from cp_attention.ops import cuda_args
from cp_attention.ops.checks import check_paged_args, check_varlen_args
from cp_attention.ops.interface import (AttentionOps, Mask, accumulation_dtype, empty_result,
                                        falls_back, used_key_lengths, used_key_rows)
from cp_attention.ops.merge import merge_attn_states
from cp_attention.ops.paged_plan import plan_paged
from cp_attention.ops.reference import ReferenceOps


def load_flash_attn() -> ModuleType | None:
    """The flash_attn module, or None when it is not importable."""
    try:
        return importlib.import_module("flash_attn")
    except Exception:  # ImportError, or a broken CUDA extension
        return None


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request in the accumulation dtype: q [nq, Hq, D], k/v [nk, Hkv, D], visible
    [nq, nk] -> out [nq, Hq, D], lse [nq, Hq]; rows without keys give 0 / -inf."""
    acc = accumulation_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    k = k.to(acc).repeat_interleave(group, dim=1)
    v = v.to(acc).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for empty rows
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse_safe[..., None]), v)
    return out, lse.transpose(0, 1)


class CudaOps(AttentionOps):
    """flash-attn kernels when available, explicit math otherwise.

    use_flash: None = auto (flash-attn importable and q float16/bfloat16; else the explicit
    math, as a fallback), False = never (the explicit math, no fallback).
    """

    name = "cuda"

    def __init__(self, use_flash: bool | None = None) -> None:
        self._explicit_only = use_flash is False
        self._flash = load_flash_attn() if use_flash is not False else None
        self._flash_seqused_k = self._flash is not None and cuda_args.takes_seqused_k(
            self._flash.flash_attn_varlen_func)
        self._reference = ReferenceOps()

    def _use_flash(self, op: str, dtype: torch.dtype) -> bool:
        """Whether flash-attn runs a call of ``op`` in ``dtype`` (else the explicit math)."""
        if self._explicit_only:
            return False
        reason = ("flash_attn not importable" if self._flash is None else
                  f"q dtype {dtype}" if dtype not in cuda_args.FLASH_DTYPES else None)
        return not falls_back(f"CudaOps.{op}", reason)

    def _varlen(self, q, k, v, bounds_q: list[int], bounds_k: list[int], scale: float,
                mask: Mask, flash: bool, used: list[int] | None = None):
        """Packed varlen attention -> (out acc dtype, lse [T, H] acc dtype); request i attends
        the first ``used[i]`` keys of its ``bounds_k`` range (all of them when None)."""
        acc = accumulation_dtype(q.dtype)
        out, lse = empty_result(q, acc)
        n_k = used_key_lengths(bounds_k, used)
        if q.shape[0] == 0 or sum(n_k) == 0:
            return out, lse
        if flash:
            extra = {}
            if used is not None and self._flash_seqused_k:
                extra["seqused_k"] = cuda_args.int32_cu_seqlens(torch.tensor(used), q.device)
            elif used is not None:  # flash-attn 2's wrapper: pack the used prefixes
                rows, bounds_k = used_key_rows(bounds_k, used, k.device)
                k, v = k.index_select(0, rows), v.index_select(0, rows)
            res = self._flash.flash_attn_varlen_func(
                q.contiguous(), k.contiguous(), v.contiguous(),
                cuda_args.int32_cu_seqlens(torch.tensor(bounds_q), q.device),
                cuda_args.int32_cu_seqlens(torch.tensor(bounds_k), q.device),
                cuda_args.max_seqlen(bounds_q), cuda_args.max_seqlen(bounds_k), dropout_p=0.0,
                softmax_scale=float(scale), causal=mask.causal, window_size=mask.bounds,
                return_attn_probs=True,
                **extra)
            o, l = res[0], cuda_args.lse_to_th(res[1], q.shape[0], q.shape[1])
            visible = torch.cat([
                cuda_args.dense_visibility(b - a, nk, mask, q.device).any(1)
                for a, b, nk in zip(bounds_q, bounds_q[1:], n_k)])
            out = torch.where(visible[:, None, None], o.to(acc), out)
            lse = torch.where(visible[:, None], l.to(acc), lse)
            return out, lse
        for r in range(len(bounds_q) - 1):
            qs, qe, ks = bounds_q[r], bounds_q[r + 1], bounds_k[r]
            ke = ks + n_k[r]
            if qe > qs and ke > ks:
                vis = cuda_args.dense_visibility(qe - qs, ke - ks, mask, q.device)
                out[qs:qe], lse[qs:qe] = explicit_attention(q[qs:qe], k[ks:ke], v[ks:ke],
                                                            scale, vis)
        return out, lse

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal,
                         window=None, seqused_k=None):
        """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (out [Tq, Hq, D], lse [Tq, Hq])."""
        check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
        return self._varlen(q, k, v, [int(x) for x in cu_seqlens_q.tolist()],
                            [int(x) for x in cu_seqlens_k.tolist()], scale, Mask(causal, window),
                            self._use_flash("varlen_attention", q.dtype),
                            None if seqused_k is None else [int(x) for x in seqused_k.tolist()])

    def paged_attention(self, q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                        *, scale, kv_start=None, kv_end=None):
        """q [Tq, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_table [R, max_blocks]."""
        check_paged_args(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)
        acc = accumulation_dtype(q.dtype)
        block_size, hkv, d = key_cache.shape[1:]
        calls, _ = plan_paged(
            [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in seq_lens.tolist()],
            block_size, None if kv_start is None else [int(x) for x in kv_start.tolist()],
            None if kv_end is None else [int(x) for x in kv_end.tolist()])
        out, lse = empty_result(q, acc)
        flat_k, flat_v = key_cache.view(-1, hkv, d), value_cache.view(-1, hkv, d)
        flash = self._use_flash("paged_attention", q.dtype)
        for call in calls:
            rows = torch.tensor(call.query_rows(), dtype=torch.long, device=q.device)
            slots, bounds_k = cuda_args.paged_gather(block_table.to(q.device), call, block_size)
            o, l = self._varlen(q.index_select(0, rows), flat_k.index_select(0, slots),
                                flat_v.index_select(0, slots), call.cu_seqlens_q(), bounds_k,
                                scale, call.interface_mask(), flash)
            out[rows], lse[rows] = o, l
        return out, lse

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        """Store key/value [T, Hkv, D] at their slots; -1 slots skipped."""
        self._reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b):
        return merge_attn_states(out_a, lse_a, out_b, lse_b)
