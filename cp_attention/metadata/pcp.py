"""Prefill partitions: how prefills' new tokens are cut over PCP ranks (pure index math).

A :class:`PrefillPartition` (one subclass per strategy) defines two things: the chunk size
``c`` of each prefill and the chunks each rank keeps, in local order. Everything else is
derived from that one definition: the padded rows (``num_chunks * c`` per prefill), each
rank's rows, the restore order of the rank-major all-gather (the ownership table inverted,
in closed form per chunk) and the scatter (the inverse permutation of the restore order).
:class:`HeadTail` (docs/pcp.md section 1) is the first strategy.

Local rows of a rank: for each prefill, its ``m`` chunks in local order (``m c`` rows, pads
included). Restored rows: for each prefill, its padded tokens in order (request offsets =
cumulative padded lengths); every K/V index points into them. With ``C = cumsum0(c)`` (``P``
prefills), prefill ``i`` starts at local row ``m C[i]`` and at restored row
``num_chunks C[i]``; no index needs argsort or another rank's rows.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
import numpy as np
import torch

from cp_attention.metadata.common import cumsum0, equal_ranges, ranges_concat


_tensor = torch.from_numpy  # an int64 array as a tensor sharing its memory


class PrefillPartition(ABC):
    """A cut of each prefill's new tokens into ``num_chunks`` chunks of ``c`` rows over
    ``pcp_size`` ranks. Subclasses define :meth:`chunk_lens` and :meth:`chunks_of`."""

    def __init__(self, pcp_size: int) -> None:
        self.pcp_size = pcp_size
        table = np.array([self.chunks_of(r) for r in range(pcp_size)], dtype=np.int64)
        self.num_chunks, self.chunks_per_rank = table.size, table.shape[1]
        if not np.array_equal(np.sort(table, axis=None), np.arange(table.size)):
            raise ValueError(f"{type(self).__name__}: each chunk must have exactly one rank")
        # the ownership table inverted: [num_chunks] the rank that keeps each chunk, and where
        self.rank_of_chunk = np.empty(self.num_chunks, dtype=np.int64)
        self.slot_of_chunk = np.empty(self.num_chunks, dtype=np.int64)
        self.rank_of_chunk[table] = np.arange(pcp_size)[:, None]
        self.slot_of_chunk[table] = np.arange(self.chunks_per_rank)[None, :]

    @abstractmethod
    def chunk_lens(self, new_lens: np.ndarray) -> np.ndarray:
        """[P] int64 chunk size c of each prefill of ``new_lens`` ([P]) new tokens."""

    @abstractmethod
    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks ``rank`` keeps, in local order (the same count for every rank)."""

    def local_segments(self, chunk_lens: np.ndarray, rank: int
                       ) -> tuple[np.ndarray, np.ndarray]:
        """[P m] (first padded position, rows) of each local segment: prefill-major, chunks
        in local order."""
        starts = np.multiply.outer(chunk_lens, self.chunks_of(rank)).reshape(-1)
        return starts, chunk_lens.repeat(self.chunks_per_rank)

    def local_rows(self, chunk_lens: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """[m sum c] (prefill number, padded position) of each local row of ``rank``."""
        starts, lengths = self.local_segments(chunk_lens, rank)
        req = np.arange(len(chunk_lens)).repeat(self.chunks_per_rank * chunk_lens)
        return req, ranges_concat(starts, lengths)

    def restored_rows(self, chunk_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[pcp m sum c] (prefill number, padded position) of each restored row."""
        padded = self.num_chunks * chunk_lens
        return (np.arange(len(chunk_lens)).repeat(padded),
                ranges_concat(np.zeros(len(padded), dtype=np.int64), padded))

    def restore_runs(self, chunk_lens: np.ndarray, cu: np.ndarray | None = None) -> np.ndarray:
        """[P, num_chunks] gathered row of the first row of each restored chunk (closed form).

        Restored chunk ``(i, k)`` (prefill i, chunk k) was sent by the rank ``q`` keeping
        chunk k, at slot ``s`` of its local order: gathered rows ``q m sum c + m C[i] +
        s c[i] + j``, j < c[i]. ``cu``: [P + 1] ``cumsum0(c)`` when the caller has it.
        """
        c, m = chunk_lens, self.chunks_per_rank
        cu = cumsum0(c) if cu is None else cu
        starts = c[:, None] * self.slot_of_chunk  # [P, num_chunks]
        starts += self.rank_of_chunk * (m * int(cu[-1]))
        starts += (m * cu[:-1])[:, None]
        return starts

    def plan(self, new_lens: np.ndarray, rank: int) -> dict[str, torch.Tensor]:
        """The split of prefills with ``new_lens`` ([P]) new tokens for ``rank``: the PCP
        fields of :class:`~cp_attention.metadata.builder.AttentionMetadata`, by name
        (``chunk_cu_seqlens`` [P + 1] C, ``local_chunk_cu_seqlens`` [m P + 1] the local rows
        of each chunk in local order (prefill by prefill, its m chunks in turn: every
        diagonal in one causal call), ``chunk_q_idx`` [m, sum c], ``chunk_keys_before``
        [m, P], ``pcp_allgather_restore_idx`` [pcp m sum c] and its
        inverse ``pcp_allgather_scatter_idx``; int64 tensors)."""
        if not 0 <= rank < self.pcp_size:
            raise ValueError(f"pcp_rank ({rank}) must be in [0, pcp_size={self.pcp_size})")
        c = self.chunk_lens(new_lens)
        cu = cumsum0(c)  # [P + 1]
        m = self.chunks_per_rank
        equal = len(c) < 2 or bool((c == c[0]).all())  # every index has segments of c rows
        # local chunk s of prefill i: rows local_cu[i m + s] + j = m C[i] + s c[i] + j
        local_cu = cumsum0(np.repeat(c, m))
        q_idx = chunk_ranges(local_cu[:-1].reshape(-1, m).T, c[None, :], equal).reshape(m, -1)
        runs = self.restore_runs(c, cu)
        return {"chunk_cu_seqlens": _tensor(cu), "local_chunk_cu_seqlens": _tensor(local_cu),
                "chunk_q_idx": _tensor(q_idx),
                "chunk_keys_before": _tensor(np.multiply.outer(self.chunks_of(rank), c)),
                "pcp_allgather_restore_idx": _tensor(chunk_ranges(runs, c[:, None], equal)),
                "pcp_allgather_scatter_idx": _tensor(inverse_of_runs(
                    runs.reshape(-1), c.repeat(self.num_chunks), equal))}


class HeadTail(PrefillPartition):
    """Each prefill padded to ``2 pcp c`` rows; rank r keeps chunk r (head) and chunk
    ``2 pcp - 1 - r`` (tail), so every rank's query chunks cover the same causal area."""

    def chunk_lens(self, new_lens: np.ndarray) -> np.ndarray:
        chunks = 2 * self.pcp_size
        return (np.asarray(new_lens, dtype=np.int64) + (chunks - 1)) // chunks

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.pcp_size - 1 - rank


def inverse_of_runs(starts: np.ndarray, lengths: np.ndarray, equal: bool | None = None
                    ) -> np.ndarray:
    """The inverse permutation of ``ranges_concat(starts, lengths)`` (a permutation made of
    [S] runs): each run's target rows, taken in the order of the runs' starts (argsort of S
    segments, not of every row)."""
    order = np.argsort(starts, kind="stable")
    return ranges_concat(cumsum0(lengths)[:-1][order], lengths[order], equal)


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
