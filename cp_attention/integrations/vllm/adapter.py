"""Translation between vLLM's per-step inputs and cp_attention's (pure; no vLLM import).

vLLM numbers a step's new tokens in its batch order (``query_start_loc``); our metadata
numbers them the same way (``StepSpec`` global token index), so ``local_token_idx`` of our
metadata is directly the vLLM token index of each of our rows. Our rows put decodes first,
then prefills; vLLM's reorder puts ``query_len <= reorder_batch_threshold`` first, which
also includes prompts of one token without context (a prefill for us), so the two orders
may differ and rows are gathered / scattered with ``local_token_idx``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cp_attention.config import CPConfig
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.metadata.common import StepSpec


class SlotMappingMismatch(RuntimeError):
    """vLLM's slot mapping for a step differs from the one cp_attention computed."""


def cp_config_from_vllm(parallel_config, block_size: int, decode_threshold: int = 1,
                        kv_shard: str = "dcp") -> CPConfig:
    """CPConfig of a vLLM deployment (``parallel_config``: vLLM ``ParallelConfig``-like)."""
    return CPConfig(
        pcp_size=int(parallel_config.prefill_context_parallel_size),
        dcp_size=int(parallel_config.decode_context_parallel_size),
        tp_size=int(parallel_config.tensor_parallel_size),
        block_size=int(block_size),
        cp_kv_interleave_size=int(parallel_config.cp_kv_cache_interleave_size),
        kv_shard=kv_shard,
        decode_threshold=int(decode_threshold),
    )


@dataclass(frozen=True)
class VllmStep:
    """A vLLM step as a :class:`StepSpec`; ``num_tokens`` = real tokens (``query_start_loc[-1]``)."""

    step: StepSpec
    num_tokens: int


def step_from_vllm(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor,
                   block_table: torch.Tensor, num_reqs: int) -> VllmStep:
    """StepSpec from vLLM's ``CommonAttentionMetadata`` fields (CPU tensors).

    query_start_loc_cpu: [>= R + 1]; seq_lens_cpu: [>= R] total length incl. this step;
    block_table: [>= R, max_blocks] (virtual blocks under DCP). Requests with no new tokens
    (batch padding) are dropped; they hold no token rows so token numbering is unchanged.
    """
    qsl = query_start_loc_cpu[:num_reqs + 1].to(torch.int64).numpy()
    new = np.diff(qsl)
    seq_lens = seq_lens_cpu[:num_reqs].to(torch.int64).numpy()
    keep = np.nonzero(new > 0)[0]
    computed = seq_lens[keep] - new[keep]
    if (computed < 0).any():
        r = int(keep[np.argmax(computed < 0)])
        raise ValueError(f"vLLM request {r}: seq_len {int(seq_lens[r])} < query_len {int(new[r])}")
    table = block_table[:num_reqs]
    if len(keep) != num_reqs:
        table = table[torch.from_numpy(keep)]
    step = StepSpec(tuple(computed.tolist()), tuple(new[keep].tolist()), table)
    return VllmStep(step, int(qsl[-1]) if num_reqs else 0)


def row_order(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor | None:
    """vLLM token index of each of our rows ([num_actual_tokens] int64), or None if identical.

    Only for layouts without padding rows (pcp_size == 1).
    """
    idx = meta.local_token_idx[:meta.num_actual_tokens]
    if meta.num_actual_tokens != num_tokens or bool((idx < 0).any()):
        raise ValueError(f"rows ({meta.num_actual_tokens}, pads included) do not match vLLM's "
                         f"{num_tokens} tokens one to one (pcp_size > 1 is not supported in vLLM)")
    if bool((idx == torch.arange(num_tokens)).all()):
        return None
    return idx


def slots_in_vllm_order(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """Our step slot mapping, re-indexed by vLLM token ([num_tokens] int64; -1 = not stored)."""
    rows = meta.local_token_idx[:meta.num_actual_tokens]
    out = torch.full((num_tokens,), -1, dtype=torch.int64)
    real = rows >= 0
    out[rows[real]] = meta.step_slot_mapping[:meta.num_actual_tokens][real]
    return out


def check_slot_mapping(meta: AttentionMetadata, vllm_slots: torch.Tensor, num_tokens: int,
                       step: StepSpec, where: str = "") -> None:
    """Raise :class:`SlotMappingMismatch` unless vLLM's slots equal ours for every token."""
    ours = slots_in_vllm_order(meta, num_tokens)
    theirs = vllm_slots[:num_tokens].to(device="cpu", dtype=torch.int64)
    if torch.equal(ours, theirs):
        return
    bad = int(torch.nonzero(ours != theirs)[0, 0])
    cu = step.cu_new_tokens
    req = int(np.searchsorted(cu, bad, side="right") - 1)
    pos = step.num_computed_tokens[req] + bad - int(cu[req])
    raise SlotMappingMismatch(
        f"{where}vLLM's slot_mapping disagrees with cp_attention's for token {bad} (request "
        f"{req}, position {pos}): vLLM slot {int(theirs[bad])}, ours {int(ours[bad])} "
        f"({int((ours != theirs).sum())} of {num_tokens} tokens differ). The KV cache layouts "
        "disagree (block size, DCP size/rank or interleave); refusing to write the cache.")
