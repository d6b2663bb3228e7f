"""Head/tail split of prefill tokens over PCP ranks (pure index math, DESIGN section 3).

Each prefill's new tokens are padded (at the end) to ``2 * pcp * c`` and cut into ``2 * pcp``
chunks of ``c`` tokens. PCP rank ``r`` keeps chunk ``r`` (head) and chunk ``2 * pcp - 1 - r``
(tail), locally ordered per request as [head, tail]. Index names follow vLLM-Ascend's
``AscendPCPMetadata``; all K/V indices point into the *restored* layout: the requests' padded
token rows back in order, request offsets = cumulative padded lengths.

Every index is written in closed form per chunk (no argsort, no other rank's rows): with
``C = cumsum0(c)`` (``P`` prefills), prefill ``i`` starts at local row ``2 C[i]``, at restored
row ``2 pcp C[i]``, and chunk ``k`` of it lives on rank ``k`` (head, ``k < pcp``) or rank
``2 pcp - 1 - k`` (tail) at local row ``2 C[i]`` or ``2 C[i] + c[i]``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from cp_attention.metadata.common import cumsum0, equal_ranges, ranges_concat


class ChunkPlan(NamedTuple):
    """What attention of one query chunk (head or tail) of every prefill takes, on this rank."""

    index: int  # chunk number k: pcp_rank (head) or 2 * pcp - 1 - pcp_rank (tail)
    q_idx: torch.Tensor  # [sum c] local prefill rows of the chunk
    kv_nomask_idx: torch.Tensor  # [k sum c] restored rows before the chunk (no mask)
    nomask_cu_seqlens_k: torch.Tensor  # [P + 1] k * C
    kv_idx: torch.Tensor | None  # [(k + 1) sum c] restored rows up to the chunk's end (window)
    cu_seqlens_k: torch.Tensor  # [P + 1] (k + 1) * C


_tensor = torch.from_numpy  # an int64 array as a tensor sharing its memory


@dataclass(frozen=True)
class PCPSplit:
    """The split of one step's ``P`` prefills for one PCP rank. Index tensors are int64.

    Local rows: for each prefill, its head chunk then its tail chunk (``2 c`` rows, pads
    included). Restored rows: for each prefill, its ``2 pcp c`` padded tokens in order.
    ``[2, P]`` seqlens are (query lens, key lens); ``cu_seqlens`` are their ``[P + 1]``
    cumulative offsets, ready for varlen kernels.
    """

    pcp_size: int
    pcp_rank: int
    chunk_lens: np.ndarray  # [P] c per prefill (host bookkeeping)
    chunk_cu_seqlens: torch.Tensor  # [P + 1] C: query rows of one chunk (= its diagonal keys)
    q_head_idx: torch.Tensor  # [sum c] local rows of head chunks
    q_tail_idx: torch.Tensor  # [sum c] local rows of tail chunks
    q_full_idx: torch.Tensor  # [2 sum c] argsort(cat(q_head_idx, q_tail_idx))
    kv_with_q_head_nomask_idx: torch.Tensor  # restored rows before the head chunk
    kv_with_q_tail_nomask_idx: torch.Tensor  # restored rows before the tail chunk
    head_nomask_cu_seqlens_k: torch.Tensor  # [P + 1] head * C
    tail_nomask_cu_seqlens_k: torch.Tensor  # [P + 1] tail * C
    kv_with_q_head_idx: torch.Tensor | None  # nomask + mask rows per prefill (window only)
    kv_with_q_tail_idx: torch.Tensor | None  # nomask + mask rows per prefill (window only)
    head_cu_seqlens_k: torch.Tensor  # [P + 1] (head + 1) * C
    tail_cu_seqlens_k: torch.Tensor  # [P + 1] (tail + 1) * C
    pcp_allgather_restore_idx: torch.Tensor  # [pcp * 2 sum c]: restored = gathered[idx]
    pcp_allgather_scatter_idx: torch.Tensor  # inverse of restore: gathered = restored[idx]

    @property
    def num_local_rows(self) -> int:
        return len(self.q_full_idx)

    @property
    def head_chunk(self) -> int:
        return self.pcp_rank

    @property
    def tail_chunk(self) -> int:
        return 2 * self.pcp_size - 1 - self.pcp_rank

    @property
    def head(self) -> ChunkPlan:
        return ChunkPlan(self.head_chunk, self.q_head_idx, self.kv_with_q_head_nomask_idx,
                         self.head_nomask_cu_seqlens_k, self.kv_with_q_head_idx,
                         self.head_cu_seqlens_k)

    @property
    def tail(self) -> ChunkPlan:
        return ChunkPlan(self.tail_chunk, self.q_tail_idx, self.kv_with_q_tail_nomask_idx,
                         self.tail_nomask_cu_seqlens_k, self.kv_with_q_tail_idx,
                         self.tail_cu_seqlens_k)

    # -- vLLM-Ascend's names no kernel here reads (NPU seqlens form), made on first use ------
    @cached_property
    def kv_with_q_head_mask_idx(self) -> torch.Tensor:
        """[sum c] restored rows of the head chunk (its causal diagonal)."""
        return _tensor(self._chunk_rows(self.head_chunk))

    @cached_property
    def kv_with_q_tail_mask_idx(self) -> torch.Tensor:
        """[sum c] restored rows of the tail chunk (its causal diagonal)."""
        return _tensor(self._chunk_rows(self.tail_chunk))

    @cached_property
    def attn_mask_seqlens(self) -> torch.Tensor:
        """[2, P] (query lens, key lens) of the masked (diagonal) parts."""
        return _tensor(np.stack([self.chunk_lens, self.chunk_lens]))

    @cached_property
    def head_attn_nomask_seqlens(self) -> torch.Tensor:
        """[2, P] (query lens, key lens) of the head chunk's unmasked part."""
        return _tensor(np.stack([self.chunk_lens, self.head_chunk * self.chunk_lens]))

    @cached_property
    def tail_attn_nomask_seqlens(self) -> torch.Tensor:
        """[2, P] (query lens, key lens) of the tail chunk's unmasked part."""
        return _tensor(np.stack([self.chunk_lens, self.tail_chunk * self.chunk_lens]))

    def _chunk_rows(self, chunk: int) -> np.ndarray:
        """[sum c] restored rows of chunk ``chunk`` of every prefill."""
        c = self.chunk_lens
        return ranges_concat(2 * self.pcp_size * (np.cumsum(c) - c) + chunk * c, c)

    # -- host bookkeeping (tests, checkers, load-balance figures), made on first use ------
    @cached_property
    def local_req(self) -> np.ndarray:
        """[2 sum c] prefill number (0..P-1) of each local row."""
        return np.repeat(np.arange(len(self.chunk_lens)), 2 * self.chunk_lens)

    @cached_property
    def local_padded_pos(self) -> np.ndarray:
        """[2 sum c] position of each local row in its padded request."""
        c = self.chunk_lens
        starts = np.concatenate([self.head_chunk * c, self.tail_chunk * c]).reshape(2, -1)
        return ranges_concat(starts.T.reshape(-1), np.repeat(c, 2))

    @cached_property
    def restored_req(self) -> np.ndarray:
        """[pcp * 2 sum c] prefill number of each restored row."""
        return np.repeat(np.arange(len(self.chunk_lens)), 2 * self.pcp_size * self.chunk_lens)

    @cached_property
    def restored_padded_pos(self) -> np.ndarray:
        """[pcp * 2 sum c] position of each restored row in its padded request."""
        padded = 2 * self.pcp_size * self.chunk_lens
        return ranges_concat(np.zeros(len(padded), dtype=np.int64), padded)

    @cached_property
    def pcp_prefill_mask(self) -> torch.Tensor:
        """The constant 2048 x 2048 upper-triangular mask NPU kernels take for causal parts.

        Kept for name compatibility with vLLM-Ascend (which later dropped it as redundant);
        the portable ops never read it.
        """
        return torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def chunk_lens_for(new_lens: np.ndarray, pcp_size: int) -> np.ndarray:
    """[P] int64 chunk size c of each prefill: ceil(len / (2 * pcp))."""
    return (np.asarray(new_lens, dtype=np.int64) + (2 * pcp_size - 1)) // (2 * pcp_size)


def restore_index(chunk_lens: np.ndarray, pcp_size: int, equal: bool | None = None,
                  cu: np.ndarray | None = None) -> np.ndarray:
    """[pcp * 2 sum c] gathered row of each restored row (closed form per chunk).

    Restored row ``(i, k, j)`` (prefill i, chunk k, row j) was sent by rank ``q(k)`` (``k`` or
    ``2 pcp - 1 - k``) as its head (``k < pcp``) or tail chunk: gathered row
    ``q(k) * 2 sum c + 2 C[i] + [k >= pcp] c[i] + j``. ``equal``: all ``c`` are equal
    (None: unknown), as for :func:`ranges_concat`; ``cu``: [P + 1] ``cumsum0(c)`` when the
    caller has it (None: computed here).
    """
    c = chunk_lens
    cu = cumsum0(c) if cu is None else cu
    sender, is_tail = _senders_of_chunks(pcp_size)
    starts = c[:, None] * is_tail  # [P, 2 pcp]
    starts += sender * (2 * int(cu[-1]))
    starts += (2 * cu[:-1])[:, None]
    return chunk_ranges(starts, c[:, None], equal)


def scatter_index(chunk_lens: np.ndarray, pcp_size: int, equal: bool | None = None,
                  cu: np.ndarray | None = None) -> np.ndarray:
    """[pcp * 2 sum c] restored row of each gathered row: the inverse of :func:`restore_index`.

    Gathered row ``(q, i, h, j)`` (rank q, prefill i, head/tail h, row j) is restored row
    ``2 pcp C[i] + k c[i] + j`` with ``k = q`` (head) or ``2 pcp - 1 - q`` (tail).
    ``equal`` and ``cu`` as for :func:`restore_index`.
    """
    c = chunk_lens
    cu = cumsum0(c) if cu is None else cu
    starts = _chunks_of_ranks(pcp_size) * c[:, None]  # [pcp, P, 2]
    starts += (2 * pcp_size * cu[:-1])[:, None]
    return chunk_ranges(starts, c[:, None], equal)


def chunk_ranges(starts: np.ndarray, rows: np.ndarray, equal: bool | None = None
                 ) -> np.ndarray:
    """:func:`ranges_concat` of segments given as an array ``starts`` (any shape, C order),
    segment ``s`` of ``rows[s]`` rows, ``rows`` broadcast to the shape of ``starts`` (as
    ``c[:, None]``: ``c[i]`` rows for each segment of prefill i). ``equal``: all rows are
    equal (the [segments] lengths are then never made)."""
    if equal and starts.size:
        return equal_ranges(starts.reshape(-1), int(rows.flat[0]))
    return ranges_concat(starts.reshape(-1), np.broadcast_to(rows, starts.shape).reshape(-1),
                         equal)


@functools.lru_cache(maxsize=16)
def _chunks_of_ranks(pcp_size: int) -> np.ndarray:
    """[pcp, 1, 2] (head chunk, tail chunk) of every PCP rank (read-only)."""
    q = np.arange(pcp_size, dtype=np.int64)
    chunks = np.stack([q, 2 * pcp_size - 1 - q], axis=1)[:, None, :]
    chunks.flags.writeable = False
    return chunks


@functools.lru_cache(maxsize=16)
def _senders_of_chunks(pcp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[2 pcp] rank that holds each chunk, and whether it is that rank's tail (read-only)."""
    k = np.arange(2 * pcp_size, dtype=np.int64)
    sender, is_tail = np.minimum(k, 2 * pcp_size - 1 - k), k >= pcp_size
    sender.flags.writeable = is_tail.flags.writeable = False
    return sender, is_tail


def plan_pcp_split(new_lens: np.ndarray, pcp_size: int, pcp_rank: int, windowed: bool = False
                   ) -> PCPSplit:
    """Plan the head/tail split of prefills with ``new_lens`` ([P]) new tokens for ``pcp_rank``.

    windowed: also make ``kv_with_q_{head,tail}_idx`` (one windowed call per chunk instead of
    unmasked + diagonal); None otherwise.
    """
    if not 0 <= pcp_rank < pcp_size:
        raise ValueError(f"pcp_rank ({pcp_rank}) must be in [0, pcp_size={pcp_size})")
    c = chunk_lens_for(new_lens, pcp_size)
    head, tail = pcp_rank, 2 * pcp_size - 1 - pcp_rank
    cu = cumsum0(c)  # [P + 1]
    total = int(cu[-1])
    first = cu[:-1]
    equal = len(c) < 2 or bool((c == c[0]).all())  # every index below has segments of c rows
    restored_start = 2 * pcp_size * first  # first restored row of each prefill
    q_head = ranges_concat(2 * first, c, equal)  # local row 2 C[i] + j
    q_tail = ranges_concat(2 * first + c, c, equal)  # local row 2 C[i] + c[i] + j
    # local row (i, h, j) is row h T + C[i] + j of cat(head rows, tail rows), T = sum c
    q_full = chunk_ranges(np.add.outer(first, (0, total)), c[:, None], equal)
    # [4, P + 1] key offsets: head C, tail C (unmasked parts), (head + 1) C, (tail + 1) C
    cu_k = np.multiply.outer((head, tail, head + 1, tail + 1), cu)
    head_kv = tail_kv = None
    if windowed:
        head_kv = _tensor(ranges_concat(restored_start, (head + 1) * c, equal))
        tail_kv = _tensor(ranges_concat(restored_start, (tail + 1) * c, equal))
    return PCPSplit(
        pcp_size=pcp_size,
        pcp_rank=pcp_rank,
        chunk_lens=c,
        chunk_cu_seqlens=_tensor(cu),
        q_head_idx=_tensor(q_head),
        q_tail_idx=_tensor(q_tail),
        q_full_idx=_tensor(q_full),
        kv_with_q_head_nomask_idx=_tensor(ranges_concat(restored_start, head * c, equal)),
        kv_with_q_tail_nomask_idx=_tensor(ranges_concat(restored_start, tail * c, equal)),
        head_nomask_cu_seqlens_k=_tensor(cu_k[0]),
        tail_nomask_cu_seqlens_k=_tensor(cu_k[1]),
        kv_with_q_head_idx=head_kv,
        kv_with_q_tail_idx=tail_kv,
        head_cu_seqlens_k=_tensor(cu_k[2]),
        tail_cu_seqlens_k=_tensor(cu_k[3]),
        pcp_allgather_restore_idx=_tensor(restore_index(c, pcp_size, equal, cu)),
        pcp_allgather_scatter_idx=_tensor(scatter_index(c, pcp_size, equal, cu)),
    )
