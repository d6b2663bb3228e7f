"""Head/tail split of prefill tokens over PCP ranks (pure index math, DESIGN section 3).

Each prefill's new tokens are padded (at the end) to ``2 * pcp * c`` and cut into ``2 * pcp``
chunks of ``c`` tokens. PCP rank ``r`` keeps chunk ``r`` (head) and chunk ``2 * pcp - 1 - r``
(tail), locally ordered per request as [head, tail]. Index names follow vLLM-Ascend's
``AscendPCPMetadata``; all K/V indices point into the *restored* layout: the requests' padded
token rows back in order, request offsets = cumulative padded lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from cp_attention.metadata.common import cumsum0, ranges_concat


@dataclass(frozen=True)
class PCPSplit:
    """The split of one step's prefills for one PCP rank. Index tensors are int64.

    Local rows: for each prefill, its head chunk then its tail chunk (``2 * c`` rows, pads
    included). Restored rows: for each prefill, its padded tokens in order.
    """

    pcp_size: int
    pcp_rank: int
    chunk_lens: np.ndarray  # [P] c per prefill
    q_head_idx: torch.Tensor  # [sum c] local rows of head chunks
    q_tail_idx: torch.Tensor  # [sum c] local rows of tail chunks
    q_full_idx: torch.Tensor  # [2 sum c] argsort(cat(q_head_idx, q_tail_idx))
    kv_with_q_head_nomask_idx: torch.Tensor  # restored rows before the head chunk
    kv_with_q_head_mask_idx: torch.Tensor  # restored rows of the head chunk
    kv_with_q_tail_nomask_idx: torch.Tensor  # restored rows before the tail chunk
    kv_with_q_tail_mask_idx: torch.Tensor  # restored rows of the tail chunk
    attn_mask_seqlens: torch.Tensor  # [2, P] (query lens, key lens) of the masked parts
    head_attn_nomask_seqlens: torch.Tensor  # [2, P] (query lens, key lens), head unmasked part
    tail_attn_nomask_seqlens: torch.Tensor  # [2, P] (query lens, key lens), tail unmasked part
    kv_with_q_head_idx: torch.Tensor  # nomask + mask rows per prefill (windowed attention)
    kv_with_q_tail_idx: torch.Tensor  # nomask + mask rows per prefill (windowed attention)
    pcp_allgather_restore_idx: torch.Tensor  # [pcp * 2 sum c]: restored = gathered[idx]
    pcp_allgather_scatter_idx: torch.Tensor  # argsort(restore): gathered = restored[idx]
    local_padded_pos: np.ndarray  # [2 sum c] position of each local row in its padded request
    local_req: np.ndarray  # [2 sum c] prefill number (0..P-1) of each local row
    restored_padded_pos: np.ndarray  # [pcp * 2 sum c] position of each restored row
    restored_req: np.ndarray  # [pcp * 2 sum c] prefill number of each restored row

    @property
    def num_local_rows(self) -> int:
        return int(2 * self.chunk_lens.sum())

    @cached_property
    def pcp_prefill_mask(self) -> torch.Tensor:
        """The constant 2048 x 2048 upper-triangular mask NPU kernels take for causal parts.

        Kept for name compatibility with vLLM-Ascend (which later dropped it as redundant);
        the portable ops never read it.
        """
        return torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))


def chunk_lens_for(new_lens: np.ndarray, pcp_size: int) -> np.ndarray:
    """Chunk size c of each prefill: ceil(len / (2 * pcp))."""
    return -(-np.asarray(new_lens, dtype=np.int64) // (2 * pcp_size))


def rank_rows(chunk_lens: np.ndarray, pcp_size: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Local rows of ``rank``: (prefill number, position in padded request) of each row."""
    num = len(chunk_lens)
    head, tail = rank, 2 * pcp_size - 1 - rank
    # Per prefill two segments: [head * c, head * c + c) then [tail * c, tail * c + c).
    starts = np.stack([head * chunk_lens, tail * chunk_lens], axis=1).reshape(-1)
    lengths = np.repeat(chunk_lens, 2)
    padded_pos = ranges_concat(starts, lengths)
    req = np.repeat(np.arange(num), 2 * chunk_lens)
    return req, padded_pos


def plan_pcp_split(new_lens: np.ndarray, pcp_size: int, pcp_rank: int) -> PCPSplit:
    """Plan the head/tail split of prefills with ``new_lens`` new tokens for ``pcp_rank``."""
    if not 0 <= pcp_rank < pcp_size:
        raise ValueError(f"pcp_rank ({pcp_rank}) must be in [0, pcp_size={pcp_size})")
    chunk = chunk_lens_for(new_lens, pcp_size)
    num = len(chunk)
    head, tail = pcp_rank, 2 * pcp_size - 1 - pcp_rank
    local_offsets = cumsum0(2 * chunk)[:-1]
    padded_offsets = cumsum0(2 * pcp_size * chunk)[:-1]
    q_head = ranges_concat(local_offsets, chunk)
    q_tail = ranges_concat(local_offsets + chunk, chunk)
    local_req, local_pos = rank_rows(chunk, pcp_size, pcp_rank)

    gathered = [rank_rows(chunk, pcp_size, r) for r in range(pcp_size)]  # rank-major
    gathered_req = np.concatenate([g[0] for g in gathered])
    gathered_pos = np.concatenate([g[1] for g in gathered])
    restore = np.argsort(padded_offsets[gathered_req] + gathered_pos, kind="stable")

    zeros = np.zeros(num, dtype=np.int64)
    return PCPSplit(
        pcp_size=pcp_size,
        pcp_rank=pcp_rank,
        chunk_lens=chunk,
        q_head_idx=_as_tensor(q_head),
        q_tail_idx=_as_tensor(q_tail),
        q_full_idx=_as_tensor(np.argsort(np.concatenate([q_head, q_tail]), kind="stable")),
        kv_with_q_head_nomask_idx=_as_tensor(ranges_concat(padded_offsets, head * chunk)),
        kv_with_q_head_mask_idx=_as_tensor(ranges_concat(padded_offsets + head * chunk, chunk)),
        kv_with_q_tail_nomask_idx=_as_tensor(ranges_concat(padded_offsets, tail * chunk)),
        kv_with_q_tail_mask_idx=_as_tensor(ranges_concat(padded_offsets + tail * chunk, chunk)),
        attn_mask_seqlens=_as_tensor(np.stack([chunk, chunk])),
        head_attn_nomask_seqlens=_as_tensor(np.stack([chunk, head * chunk + zeros])),
        tail_attn_nomask_seqlens=_as_tensor(np.stack([chunk, tail * chunk + zeros])),
        kv_with_q_head_idx=_as_tensor(ranges_concat(padded_offsets, (head + 1) * chunk)),
        kv_with_q_tail_idx=_as_tensor(ranges_concat(padded_offsets, (tail + 1) * chunk)),
        pcp_allgather_restore_idx=_as_tensor(restore),
        pcp_allgather_scatter_idx=_as_tensor(np.argsort(restore, kind="stable")),
        local_padded_pos=local_pos,
        local_req=local_req,
        restored_padded_pos=gathered_pos[restore],
        restored_req=gathered_req[restore],
    )
