"""The window-aware PCP exchange of a sliding-window layer (pure index math, docs/pcp.md).

A query at position t of a window-``w`` layer reads keys ``[t - w + 1, t]``. Under PCP each
rank already holds its own chunks' K/V, so its queries need from the other ranks only the
*halo* of each chunk: the ``w - 1`` positions before it (fewer at the start of a prefill).
The cache write needs the rows this rank's KV shard stores (``CPConfig.window_cache``). Each rank
sends the union of what the others need from its rows, padded to the longest sender's count
(one all-gather of equal parts); every rank plans every rank's needs from the same step, so
the plan is the same everywhere and nothing but K/V moves.

Rows are indexed as in :mod:`cp_attention.metadata.pcp`: *local* rows ``[Lp]`` (this rank's
chunks, in local order) and *restored* rows (each prefill's padded positions in order); the
exchange adds *source* rows ``[Lp + pcp S]``: the local rows, then the all-gather's rank-major
parts of ``S`` rows.
"""
from __future__ import annotations

import numpy as np
import torch

from cp_attention.metadata.common import cumsum0, ranges_concat
from cp_attention.metadata.kv_layout import KVSharding
from cp_attention.metadata.pcp import PrefillPartition


def window_exchange_plan(partition: PrefillPartition, chunk_lens: np.ndarray,
                         new_lens: np.ndarray, computed: np.ndarray, window: int,
                         sharding: KVSharding, kv_ranks: np.ndarray, rank: int,
                         step_slots: np.ndarray, window_cache: str
                         ) -> dict[str, torch.Tensor]:
    """The window exchange of ``rank`` for prefills of ``chunk_lens`` [P] (c), ``new_lens``
    [P] real tokens after ``computed`` [P] cached ones; ``kv_ranks`` [pcp]: the KV shard each
    PCP rank writes; ``step_slots`` [restored rows]: this rank's cache slot of each restored
    row (-1: not stored here). ``window_cache``: "all" writes every row of the shard (a
    prefix-cache hit may read any), "window" only the last ``window - 1`` rows of each prefill
    (all a later step of the request reads).

    Returns int64 tensors: ``window_send_idx`` [S] local rows sent (padded with row 0),
    ``window_key_idx`` [keys] source row of each key, ``window_key_cu_seqlens`` [m P + 1]
    keys of each local chunk (its halo, then itself), ``window_write_idx`` [writes] source
    rows written to the cache and ``window_write_slots`` [writes] their slots."""
    pcp, m = partition.pcp_size, partition.chunks_per_rank
    c = chunk_lens
    padded = partition.num_chunks * c
    cu_restored = cumsum0(padded)
    req = np.arange(len(c)).repeat(padded)  # [restored rows] prefill of each row
    pos = np.arange(int(cu_restored[-1]), dtype=np.int64) - cu_restored[:-1][req]
    c_row = c[req]
    chunk = pos // c_row
    owner = partition.rank_of_chunk[chunk]
    real = pos < new_lens[req]
    # [pcp, restored rows] what each rank needs: its chunks' halos, the rows its shard writes
    needs = np.zeros((pcp, len(pos)), dtype=bool)
    last = (pos + window - 1) // c_row  # a row is in the halo of the chunks (chunk, last]
    stored = sharding.owner(computed[req] + pos)
    writes = real if window_cache == "all" else real & (pos >= new_lens[req] - (window - 1))
    for q in range(pcp):
        for k in partition.chunks_of(q):
            needs[q] |= (chunk < k) & (k <= last) & (k * c_row < new_lens[req])
        needs[q] |= writes & (stored == kv_ranks[q])
    sent = np.zeros(len(pos), dtype=bool)  # rows some other rank needs from their owner
    for q in range(pcp):
        sent |= needs[q] & (owner != q)
    counts = np.bincount(owner[sent], minlength=pcp)
    size = int(counts.max()) if len(pos) else 0
    # local row of each restored row in its owner's local order, and its place in the send
    local_row = (m * cumsum0(c)[:-1])[req] + partition.slot_of_chunk[chunk] * c_row + pos % c_row
    place = np.full(len(pos), -1, dtype=np.int64)
    for q in range(pcp):
        mine = np.flatnonzero(sent & (owner == q))
        place[mine] = np.arange(len(mine))
    send = local_row[sent & (owner == rank)]
    send_idx = np.zeros(size, dtype=np.int64)
    send_idx[:len(send)] = send
    num_local = m * int(c.sum())
    source = np.where(owner == rank, local_row, num_local + owner * size + place)
    # each local chunk's keys: positions [max(0, k c - (w - 1)), k c + c), prefill-major
    starts, lengths = partition.local_segments(c, rank)
    halo = np.minimum(starts, window - 1)
    halo[starts >= np.repeat(new_lens, m)] = 0  # a chunk of pads alone reads no halo
    keys = ranges_concat(np.repeat(cu_restored[:-1], m) + starts - halo, halo + lengths)
    written = np.flatnonzero(writes & (stored == kv_ranks[rank]))
    return {"window_send_idx": torch.from_numpy(send_idx),
            "window_key_idx": torch.from_numpy(source[keys]),
            "window_key_cu_seqlens": torch.from_numpy(cumsum0(halo + lengths)),
            "window_write_idx": torch.from_numpy(source[written]),
            "window_write_slots": torch.from_numpy(step_slots[written])}
