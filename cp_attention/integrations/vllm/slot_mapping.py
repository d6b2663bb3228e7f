"""CP-aware CPU replacement for vLLM's slot-mapping kernel (imports vLLM lazily).

vLLM computes each new token's KV-cache slot with a Triton kernel
(``vllm/v1/worker/block_table.py``, ``ComputeSlotMappingKernel.kernel``); on CPU the platform
swaps in ``vllm.utils.cpu_triton_utils._compute_slot_mapping_kernel_impl``, which asserts a CP
world of 1 (``cpu_triton_utils.py:27``). Under DCP every rank stores the tokens it owns, at the
slots of :class:`~cp_attention.metadata.kv_layout.KVSharding` (the builder's definition);
other ranks get ``PAD_ID``.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from cp_attention.metadata.kv_layout import KVSharding

_MARK = "_cp_attention_slot_mapping"


def cp_slot_mapping(query_start_loc: torch.Tensor, positions: torch.Tensor,
                    block_table: torch.Tensor, block_size: int, world: int, rank: int,
                    interleave: int, pad_id: int = -1) -> torch.Tensor:
    """Slots of the step's tokens on ``rank``: int64 [num_tokens], ``pad_id`` where not stored.

    query_start_loc: [R + 1] token offsets per request; positions: [>= num_tokens] global
    positions; block_table: [>= R, max_blocks] virtual block ids (CPU tensors).
    """
    qsl = query_start_loc.to(torch.int64).cpu().numpy()
    num_tokens = int(qsl[-1])
    req = np.arange(len(qsl) - 1).repeat(np.diff(qsl))
    slots = KVSharding(world, interleave, block_size).slots(
        req, positions[:num_tokens].to(torch.int64).cpu().numpy(), block_table.cpu().numpy(),
        rank)
    if pad_id != -1:
        slots[slots < 0] = pad_id
    return torch.from_numpy(slots)


def make_slot_mapping_impl(original: Callable) -> Callable:
    """Wrap vLLM's CPU impl: CP world 1 goes to ``original``, larger worlds to
    :func:`cp_slot_mapping`."""

    def impl(num_tokens, max_num_tokens, query_start_loc, positions, block_table,
             block_table_stride, slot_mapping, KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE=1,
             TOTAL_CP_RANK=0, CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1, BLOCK_SIZE=1024):
        # Same parameters, in the same order, as the function it replaces.
        if TOTAL_CP_WORLD_SIZE == 1:
            return original(num_tokens, max_num_tokens, query_start_loc, positions, block_table,
                            block_table_stride, slot_mapping, KV_CACHE_BLOCK_SIZE,
                            TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE,
                            PAD_ID, BLOCK_SIZE)
        n = int(query_start_loc[-1])
        slot_mapping[:n] = cp_slot_mapping(query_start_loc, positions, block_table,
                                           KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE,
                                           TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID)
        slot_mapping[n:max_num_tokens] = PAD_ID

    setattr(impl, _MARK, True)
    impl.__wrapped__ = original  # type: ignore[attr-defined]
    return impl


def install_slot_mapping_shim() -> bool:
    """Replace vLLM's CPU slot-mapping fallback (idempotent). Returns True if it installed."""
    import vllm.utils.cpu_triton_utils as cpu_triton_utils

    current = cpu_triton_utils._compute_slot_mapping_kernel_impl
    if getattr(current, _MARK, False):
        return False
    cpu_triton_utils._compute_slot_mapping_kernel_impl = make_slot_mapping_impl(current)
    return True
