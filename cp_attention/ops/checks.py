"""Argument checks of the attention primitives.

Two costs, one rule for every op implementation:
  * ``check_*_args``: O(1) (ranks, shapes, dtypes, devices, lengths of the index tensors);
    the reference, npu and cuda ops call theirs on every call; the C++ CPU kernels
    (``ops/cpu.py``) check the same in C++ instead (``TORCH_CHECK*``, not these functions);
  * ``validate_*``: O(n) value checks (slot ranges, monotone offsets, block ids). The ops do
    not run them; the impl runs those of its own inputs once per call in debug mode
    (:func:`cp_attention.impl.checks.check_forward_values`), and callers of the ops may too.
Each raises :class:`~cp_attention.errors.OpsInputError` (a ``ValueError``) naming the argument
and its value. The mask (causal, window) is checked where the op makes its
:class:`~cp_attention.ops.interface.Mask`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from cp_attention.config import is_int
from cp_attention.errors import OpsInputError
from cp_attention.mathutils import ceil_div
from cp_attention.ops.interface import Mask


def validate_slot_mapping(slot_mapping: torch.Tensor, num_slots: int, num_rows: int | None = None,
                          error: type[ValueError] = OpsInputError) -> None:
    """slot_mapping: [T] int; each -1 or in [0, num_slots), no slot written twice."""
    if slot_mapping.dim() != 1 or slot_mapping.dtype.is_floating_point:
        raise error(f"slot_mapping must be a 1-D integer tensor, got {slot_mapping.dtype} "
                    f"shape {tuple(slot_mapping.shape)}")
    if num_rows is not None and slot_mapping.shape[0] != num_rows:
        raise error(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_rows} key rows")
    slots = slot_mapping.detach().cpu().long()
    bad = slots[(slots < -1) | (slots >= num_slots)]
    if bad.numel():
        raise error(f"slot_mapping holds slot {int(bad[0])} outside [-1, {num_slots}) "
                    f"(num_blocks x block_size)")
    written = slots[slots >= 0]
    if written.numel() != torch.unique(written).numel():
        values, counts = torch.unique(written, return_counts=True)
        raise error(f"slot_mapping writes slot {int(values[counts > 1][0])} more than once")


def _check_offsets(cu_seqlens: torch.Tensor, name: str) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.numel() < 1:
        raise OpsInputError(f"{name} must be a non-empty 1-D integer tensor, got "
                            f"{cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}")


def validate_cu_seqlens(cu_seqlens: torch.Tensor, num_rows: int, name: str = "cu_seqlens"
                        ) -> None:
    """[R + 1] integer offsets: starts at 0, non-decreasing, ends at ``num_rows``."""
    _check_offsets(cu_seqlens, name)
    cu = cu_seqlens.detach().cpu().long()
    if int(cu[0]) != 0:
        raise OpsInputError(f"{name}[0] = {int(cu[0])} must be 0")
    steps = cu[1:] - cu[:-1]
    if (steps < 0).any():
        i = int(torch.nonzero(steps < 0)[0])
        raise OpsInputError(f"{name} decreases at index {i + 1}: {int(cu[i])} -> {int(cu[i + 1])}")
    if int(cu[-1]) != num_rows:
        raise OpsInputError(f"{name}[-1] = {int(cu[-1])} but the tensor has {num_rows} rows")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_name: str) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise OpsInputError(f"q must be [T, Hq, D] and {k_name}/values of one shape, got "
                            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise OpsInputError(f"head_size of q ({q.shape[-1]}) != head_size of {k_name} "
                            f"({k.shape[-1]})")
    if k.shape[-2] < 1 or q.shape[1] % k.shape[-2]:
        raise OpsInputError(f"q heads ({q.shape[1]}) must be a multiple of {k_name} heads "
                            f"({k.shape[-2]})")
    if k.dtype != v.dtype or q.device != k.device or k.device != v.device:
        raise OpsInputError(f"{k_name} and values must share dtype and device with q: "
                            f"{q.dtype}@{q.device}, {k.dtype}@{k.device}, {v.dtype}@{v.device}")


def check_varlen_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      seqused_k: torch.Tensor | None = None) -> None:
    """O(1) checks of ``AttentionOps.varlen_attention``: q [Tq, Hq, D], k/v [Tk, Hkv, D],
    seqused_k None or [R] integer."""
    _check_heads(q, k, v, "k")
    _check_offsets(cu_seqlens_q, "cu_seqlens_q")
    _check_offsets(cu_seqlens_k, "cu_seqlens_k")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise OpsInputError(f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} requests but "
                            f"cu_seqlens_k has {cu_seqlens_k.numel() - 1}")
    if seqused_k is not None and (seqused_k.dim() != 1 or seqused_k.dtype.is_floating_point
                                  or seqused_k.numel() != cu_seqlens_k.numel() - 1):
        raise OpsInputError(f"seqused_k must be a 1-D integer tensor of {cu_seqlens_k.numel() - 1}"
                            f" requests, got {seqused_k.dtype} shape {tuple(seqused_k.shape)}")


def validate_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           window: int | None = None,
                           seqused_k: torch.Tensor | None = None) -> None:
    """All checks of ``varlen_attention`` (O(requests)): the O(1) ones, a causal
    ``Mask(True, window)``, both offsets and ``0 <= seqused_k[i] <= cu_seqlens_k[i + 1] -
    cu_seqlens_k[i]``."""
    check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
    Mask(True, window)
    validate_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    validate_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if seqused_k is not None:
        used = seqused_k.detach().cpu().long()
        ranges = cu_seqlens_k.detach().cpu().long().diff()
        bad = torch.nonzero((used < 0) | (used > ranges))
        if bad.numel():
            i = int(bad[0])
            raise OpsInputError(f"seqused_k[{i}] = {int(used[i])} outside [0, {int(ranges[i])}]"
                                f" (the request's cu_seqlens_k range)")


def check_paged_args(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seq_lens: torch.Tensor) -> None:
    """O(1) checks of ``AttentionOps.paged_attention``: caches [num_blocks, block_size, Hkv, D],
    block_table [R, max_blocks], cu_seqlens_q [R + 1], seq_lens [R]."""
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise OpsInputError(f"key_cache and value_cache must be [num_blocks, block_size, Hkv, D]"
                            f" of one shape, got {tuple(key_cache.shape)}, "
                            f"{tuple(value_cache.shape)}")
    # [0, Hkv, D] views: no copy of a strided cache
    _check_heads(q, key_cache[:0].flatten(0, 1), value_cache[:0].flatten(0, 1), "key_cache")
    if block_table.dim() != 2 or block_table.dtype.is_floating_point:
        raise OpsInputError(f"block_table must be a 2-D integer tensor, got {block_table.dtype} "
                            f"shape {tuple(block_table.shape)}")
    _check_offsets(cu_seqlens_q, "cu_seqlens_q")
    num_reqs = block_table.shape[0]
    if cu_seqlens_q.numel() != num_reqs + 1 or seq_lens.numel() != num_reqs:
        raise OpsInputError(f"block_table has {num_reqs} rows, cu_seqlens_q "
                            f"{cu_seqlens_q.numel() - 1} requests, seq_lens {seq_lens.numel()}")


def validate_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                         block_size: int) -> None:
    """O(R x max_blocks): every block a request uses (``ceil(seq_len / block_size)`` of its
    row) is in ``[0, num_blocks)``; lengths are >= 0 and fit the table."""
    lens = seq_lens.detach().cpu().long()
    if (lens < 0).any():
        raise OpsInputError(f"seq_lens holds a negative length {int(lens[lens < 0][0])}")
    needed = ceil_div(lens, block_size)
    if needed.numel() and int(needed.max()) > block_table.shape[1]:
        r = int(torch.argmax(needed))
        raise OpsInputError(f"seq_lens[{r}] = {int(lens[r])} needs {int(needed[r])} blocks, "
                            f"block_table has {block_table.shape[1]}")
    table = block_table.detach().cpu().long()
    used = table[torch.arange(table.shape[1])[None, :] < needed[:, None]]
    bad = used[(used < 0) | (used >= num_blocks)]
    if bad.numel():
        raise OpsInputError(f"block_table holds block {int(bad[0])} outside [0, {num_blocks})")


def validate_paged_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          seq_lens: torch.Tensor) -> None:
    """All checks of ``paged_attention``: the O(1) ones, the offsets and the block table."""
    check_paged_args(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)
    validate_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    validate_block_table(block_table, seq_lens, key_cache.shape[0], key_cache.shape[1])


def check_cache_write_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """O(1) checks of ``AttentionOps.reshape_and_cache``: key/value [T, Hkv, D], caches
    [num_blocks, block_size, Hkv, D], slot_mapping [T] integer."""
    if slot_mapping.dim() != 1 or slot_mapping.dtype.is_floating_point:
        raise OpsInputError(f"slot_mapping must be a 1-D integer tensor, got "
                            f"{slot_mapping.dtype} shape {tuple(slot_mapping.shape)}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise OpsInputError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                            f"{key.shape[0]} key rows")
    if key.shape != value.shape or key_cache.dim() != 4 or value_cache.shape != key_cache.shape \
            or tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise OpsInputError(f"key/value [T, Hkv, D] {tuple(key.shape)}, {tuple(value.shape)} do "
                            f"not fit caches [num_blocks, block_size, Hkv, D] "
                            f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}")


def validate_merge_inputs(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                          lse_b: torch.Tensor) -> None:
    """out_*: [T, H, D] of one shape; lse_*: [T, H]; no NaN in the LSEs (-inf is fine)."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or \
            tuple(out_a.shape[:-1]) != tuple(lse_a.shape):
        raise OpsInputError(f"merge needs out [T, H, D] and lse [T, H] of matching shapes, got "
                            f"{tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, "
                            f"{tuple(lse_b.shape)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if bool(torch.isnan(lse).any()) or bool(torch.isposinf(lse).any()):
            raise OpsInputError(f"{name} holds NaN or +inf")


def validate_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size,
                                 supported_block_sizes: Sequence[int] | None = None) -> None:
    """Arguments of ``get_kv_cache_shape``: integers >= 1 (bools and floats rejected)."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if supported_block_sizes is not None and block_size not in supported_block_sizes:
        raise ValueError(f"block_size {block_size} is not one of {tuple(supported_block_sizes)}")
