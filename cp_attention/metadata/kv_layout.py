"""Which rank stores which cached token, and where (pure index math, DESIGN section 2).

Token ``t`` of a request is owned by KV shard ``(t // I) % W`` (``I`` = interleave size,
``W`` = number of shards) at local position ``(t // (I * W)) * I + t % I``. Block tables count
virtual blocks of ``block_size * W`` tokens; virtual block ``b`` is the physical block ``b``
of every shard.
"""
from __future__ import annotations

import numpy as np

from cp_attention.metadata.common import ranges_concat


def kv_owner(positions: np.ndarray, world: int, interleave: int) -> np.ndarray:
    """KV shard that stores each token position."""
    return (np.asarray(positions) // interleave) % world


def local_position(positions: np.ndarray, world: int, interleave: int) -> np.ndarray:
    """Position of each token inside its owner's local sequence."""
    positions = np.asarray(positions)
    return (positions // (interleave * world)) * interleave + positions % interleave


def local_count(lengths: np.ndarray, shard: int | np.ndarray, world: int, interleave: int
                ) -> np.ndarray:
    """Tokens among positions ``[0, L)`` owned by ``shard``, for each length L (vectorized).

    With ``L' = L - shard * I``: ``I`` per whole period of ``I * W`` tokens in ``L'``, plus
    ``min(L' mod I W, I)`` (floor division makes ``L' < 0`` count 0). With ``I = 1`` that is
    ``ceil(L' / W)``, written as one floor division (numpy's ``divmod`` costs ~3x as much).
    """
    if interleave == 1:
        return (np.asarray(lengths, dtype=np.int64) + (world - 1 - np.asarray(shard))) // world
    periods, rem = np.divmod(np.asarray(lengths, dtype=np.int64) - np.asarray(shard) * interleave,
                             interleave * world)
    return periods * interleave + np.minimum(rem, interleave)


def local_kv_lens(lengths: np.ndarray, world: int, interleave: int) -> np.ndarray:
    """[R, world] local cached lengths of each request on each shard."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return local_count(lengths[:, None], np.arange(world)[None, :], world, interleave)


def blocks_needed(lengths: np.ndarray, block_size: int, world: int) -> np.ndarray:
    """Virtual blocks a request of each length needs."""
    per_block = block_size * world
    return (np.asarray(lengths, dtype=np.int64) + (per_block - 1)) // per_block


def segment_slots(req: np.ndarray, first_row: np.ndarray, first_pos: np.ndarray,
                  num_tokens: np.ndarray, num_rows: int, block_table: np.ndarray, block_size: int,
                  world: int, shard: int, interleave: int) -> np.ndarray:
    """[num_rows] int64 cache slot of each row on ``shard``, -1 where nothing is stored.

    Rows come in segments: segment k holds request ``req[k]``'s tokens at global positions
    ``first_pos[k] .. + num_tokens[k]`` in rows ``first_row[k] .. + num_tokens[k]`` (rows not
    covered by a segment, e.g. pads, get -1). All inputs [S] int64. Closed form per segment:
    the shard's tokens of a segment are the local positions ``[local_count(first_pos),
    local_count(first_pos + num_tokens))``, so the work is proportional to the tokens this
    shard stores, not to every row. Equals :func:`slot_mapping` over the rows (tested).
    """
    slots = np.full(num_rows, -1, dtype=np.int64)
    # [2, S] local positions [lo, hi) of each segment's tokens held by this shard
    lo, hi = local_count(np.array((first_pos, first_pos + num_tokens)), shard, world, interleave)
    owned = hi - lo
    local = ranges_concat(lo, owned)  # local positions stored here, segment by segment
    if len(local) == 0:
        return slots
    if interleave == 1:  # global position = local * world + shard
        rows = local * world
    else:
        rows = (local // interleave) * (interleave * world) + local % interleave
    rows += (first_row - first_pos + shard * interleave).repeat(owned)
    block = local // block_size
    # table[req, block] * block_size + local % block_size, without the (slow) remainder
    slot = block_table.ravel()[block + (req * block_table.shape[1]).repeat(owned)] - block
    slot *= block_size
    slot += local
    slots[rows] = slot
    return slots


def slot_mapping(req_idx: np.ndarray, positions: np.ndarray, block_table: np.ndarray,
                 block_size: int, world: int, shard: int, interleave: int) -> np.ndarray:
    """Cache slot of each token on this shard; -1 where another shard owns it or req_idx < 0.

    req_idx, positions: [T] request (row of block_table) and global position of each token.
    """
    req_idx = np.asarray(req_idx, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    valid = req_idx >= 0
    owned = valid & (kv_owner(positions, world, interleave) == shard)
    local = local_position(positions, world, interleave)
    slots = np.full(len(positions), -1, dtype=np.int64)
    if owned.any():
        rows, loc = req_idx[owned], local[owned]
        slots[owned] = block_table[rows, loc // block_size].astype(np.int64) * block_size + loc % block_size
    return slots
