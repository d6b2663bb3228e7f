"""Ascend NPU implementation of :class:`~cp_attention.ops.interface.AttentionOps` over torch_npu.

Kernel map (argument conventions live in :mod:`cp_attention.ops.npu_args`, the request plan of
paged calls in :mod:`cp_attention.ops.paged_plan`; see docs/devices.md):

* ``varlen_attention``  -> ``torch_npu.npu_fused_infer_attention_score`` (TND, sparse_mode
  0/3/4, cumulative ``actual_seq_lengths``/``actual_seq_lengths_kv``, ``softmax_lse_flag``);
  ``seqused_k`` becomes ``actual_seq_lengths_kv``: TND K/V are packed (request i's keys end
  where request i + 1's begin), so used prefixes shorter than their ranges are packed first
  (one ``index_select`` of the used rows; whole ranges pass through uncopied);
* ``paged_attention``   -> the same op with ``block_table``/``block_size`` (per-request kv
  lengths), one call per group of requests sharing sparse arguments;
* ``reshape_and_cache`` -> ``torch_npu._npu_reshape_and_cache`` (int32 slots, -1 skipped);
* ``merge_attn_states`` -> ``torch_npu.npu_attention_update`` (update_type=1) when present.

The fused op takes float16/bfloat16 only; other dtypes (float32/float64 tests) go to
:class:`~cp_attention.ops.reference.ReferenceOps` unless ``kernel_dtypes`` says otherwise, a
fallback (:func:`~cp_attention.ops.interface.falls_back`: logged once per reason, an error
under ``CP_ATTENTION_STRICT_OPS``), as is the portable merge without ``npu_attention_update``.
``_npu_paged_attention`` is not used: it returns no LSE, which the interface requires.
torch_npu is imported lazily, on first use.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from cp_attention.ops import npu_args
from cp_attention.ops.checks import check_cache_write_args, check_paged_args, check_varlen_args
from cp_attention.ops.interface import (AttentionOps, Mask, accumulation_dtype, empty_result,
                                        falls_back, used_key_lengths, used_key_rows)
from cp_attention.ops.merge import merge_attn_states
from cp_attention.ops.paged_plan import plan_paged
from cp_attention.ops.reference import ReferenceOps


def _load_torch_npu() -> ModuleType:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("NpuOps needs torch_npu (Ascend CANN); use ReferenceOps elsewhere") from exc


class NpuOps(AttentionOps):
    """torch_npu kernels behind the ops interface.

    kernel_dtypes: input dtypes passed to the kernels (default float16/bfloat16, the fused
    op's documented dtypes); None passes every dtype (used with the CPU emulator).
    """

    name = "npu"

    def __init__(self, kernel_dtypes: tuple[torch.dtype, ...] | None = npu_args.KERNEL_DTYPES
                 ) -> None:
        self.kernel_dtypes = kernel_dtypes
        self._reference = ReferenceOps()
        self._mask_cache: dict[torch.device, torch.Tensor] = {}

    @property
    def torch_npu(self) -> ModuleType:
        return _load_torch_npu()

    def _falls_back(self, op: str, name: str, dtype: torch.dtype) -> bool:
        """Whether ``op`` hands a call whose ``name`` is of ``dtype`` to ``ReferenceOps``."""
        native = self.kernel_dtypes is None or dtype in self.kernel_dtypes
        return falls_back(f"NpuOps.{op}", None if native else f"{name} dtype {dtype}")

    def _mask(self, sparse_mode: int, device: torch.device) -> torch.Tensor | None:
        if not npu_args.needs_compressed_mask(sparse_mode):
            return None
        if device not in self._mask_cache:
            self._mask_cache[device] = npu_args.compressed_causal_mask(device)
        return self._mask_cache[device]

    def _finish(self, out: torch.Tensor, lse: torch.Tensor, visible: torch.Tensor,
                acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cast to the accumulation dtype; rows that see no key -> out 0, lse -inf."""
        visible = visible.to(out.device)
        out = torch.where(visible[:, None, None], out.to(acc), torch.zeros((), dtype=acc,
                                                                           device=out.device))
        lse = torch.where(visible[:, None], lse.to(acc),
                          torch.full((), float("-inf"), dtype=acc, device=lse.device))
        return out, lse

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal,
                         window=None, seqused_k=None):
        """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (out [Tq, Hq, D] acc dtype, lse [Tq, Hq])."""
        if self._falls_back("varlen_attention", "q", q.dtype):
            return self._reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    scale=scale, causal=causal, window=window,
                                                    seqused_k=seqused_k)
        check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
        mask = Mask(causal, window)
        acc = accumulation_dtype(q.dtype)
        cu_q = [0] + npu_args.cumulative_lengths(cu_seqlens_q)
        cu_k = [0] + npu_args.cumulative_lengths(cu_seqlens_k)
        if seqused_k is not None:
            used = used_key_lengths(cu_k, [int(x) for x in seqused_k.tolist()])
            if used != used_key_lengths(cu_k, None):  # TND has no gaps: pack the prefixes
                rows, cu_k = used_key_rows(cu_k, used, k.device)
                k, v = k.index_select(0, rows), v.index_select(0, rows)
        visible = npu_args.visible_rows_dense(cu_q, cu_k, mask.causal)
        if q.shape[0] == 0 or k.shape[0] == 0 or not bool(visible.any()):
            return empty_result(q, acc)
        mode, pre, nxt = npu_args.sparse_args(mask)
        out, lse = self.torch_npu.npu_fused_infer_attention_score(
            q.contiguous(), k.contiguous(), v.contiguous(),
            atten_mask=self._mask(mode, q.device),
            actual_seq_lengths=cu_q[1:], actual_seq_lengths_kv=cu_k[1:],
            num_heads=q.shape[1], num_key_value_heads=k.shape[1], scale=float(scale),
            pre_tokens=pre, next_tokens=nxt, input_layout="TND", sparse_mode=mode,
            softmax_lse_flag=True)
        return self._finish(out, npu_args.lse_to_th(lse, q.shape[0], q.shape[1]), visible, acc)

    def paged_attention(self, q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                        *, scale, kv_start=None, kv_end=None):
        """q [Tq, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_table [R, max_blocks]."""
        if self._falls_back("paged_attention", "q", q.dtype):
            return self._reference.paged_attention(
                q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale=scale,
                kv_start=kv_start, kv_end=kv_end)
        check_paged_args(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)
        acc = accumulation_dtype(q.dtype)
        cu_q = [0] + npu_args.cumulative_lengths(cu_seqlens_q)
        calls, visible = plan_paged(
            cu_q, [int(x) for x in seq_lens.tolist()], key_cache.shape[1],
            None if kv_start is None else [int(x) for x in kv_start.tolist()],
            None if kv_end is None else [int(x) for x in kv_end.tolist()])
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
        keys, values = npu_args.flat_cache(key_cache), npu_args.flat_cache(value_cache)
        for call in calls:
            rows = torch.tensor(call.query_rows(), dtype=torch.long, device=q.device)
            q_call = q.index_select(0, rows).contiguous()
            mode, pre, nxt = npu_args.sparse_args(call.interface_mask())
            o_call, l_call = self.torch_npu.npu_fused_infer_attention_score(
                q_call, keys, values,
                atten_mask=self._mask(mode, q.device),
                actual_seq_lengths=call.cu_seqlens_q()[1:],
                actual_seq_lengths_kv=call.kv_lengths(),
                block_table=npu_args.gather_block_table(block_table, call).to(q.device),
                num_heads=q.shape[1], num_key_value_heads=key_cache.shape[2],
                scale=float(scale), pre_tokens=pre, next_tokens=nxt,
                input_layout="TND", sparse_mode=mode,
                block_size=key_cache.shape[1], softmax_lse_flag=True)
            out[rows] = o_call.to(acc)
            lse[rows] = npu_args.lse_to_th(l_call, rows.shape[0], q.shape[1]).to(acc)
        return self._finish(out, lse, visible, acc)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        """Scatter key/value [T, Hkv, D] into the caches at ``slot_mapping`` (-1 skipped)."""
        if self._falls_back("reshape_and_cache", "key_cache", key_cache.dtype):
            self._reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
            return
        check_cache_write_args(key, value, key_cache, value_cache, slot_mapping)
        self.torch_npu._npu_reshape_and_cache(
            key=key.to(key_cache.dtype).contiguous(), value=value.to(value_cache.dtype).contiguous(),
            key_cache=key_cache, value_cache=value_cache,
            slot_indices=npu_args.slot_mapping_arg(slot_mapping, key_cache.device))

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b):
        """npu_attention_update when present and float32; rows empty on both sides fixed up."""
        update = getattr(self.torch_npu, "npu_attention_update", None)
        reason = ("torch_npu has no npu_attention_update" if update is None else
                  f"out_a dtype {out_a.dtype}" if out_a.dtype != torch.float32 else None)
        if out_a.numel() == 0 or falls_back("NpuOps.merge_attn_states", reason):
            return merge_attn_states(out_a, lse_a, out_b, lse_b)
        t, h, d = out_a.shape
        lses, outs = npu_args.attention_update_inputs(out_a, lse_a, out_b, lse_b)
        out, lse = update(lses, outs, 1)
        out, lse = out.view(t, h, d), lse.view(t, h)
        both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
        out = out.masked_fill(both_empty[..., None], 0.0)
        lse = lse.masked_fill(both_empty, float("-inf"))
        return out, lse
