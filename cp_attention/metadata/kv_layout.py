"""Which rank stores which cached token, and where (pure index math, DESIGN section 2).

Token ``t`` of a request is owned by KV shard ``(t // I) % W`` (``I`` = interleave size,
``W`` = number of shards) at local position ``(t // (I * W)) * I + t % I``. Block tables count
virtual blocks of ``block_size * W`` tokens; virtual block ``b`` is the physical block ``b``
of every shard.
"""
from __future__ import annotations

import numpy as np


def kv_owner(positions: np.ndarray, world: int, interleave: int) -> np.ndarray:
    """KV shard that stores each token position."""
    return (np.asarray(positions) // interleave) % world


def local_position(positions: np.ndarray, world: int, interleave: int) -> np.ndarray:
    """Position of each token inside its owner's local sequence."""
    positions = np.asarray(positions)
    return (positions // (interleave * world)) * interleave + positions % interleave


def local_count(lengths: np.ndarray, shard: int | np.ndarray, world: int, interleave: int
                ) -> np.ndarray:
    """Tokens among positions ``[0, L)`` owned by ``shard``, for each length L (vectorized)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    base = (lengths // (interleave * world)) * interleave
    rem = lengths - base * world
    return base + np.clip(rem - np.asarray(shard) * interleave, 0, interleave)


def local_kv_lens(lengths: np.ndarray, world: int, interleave: int) -> np.ndarray:
    """[R, world] local cached lengths of each request on each shard."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return local_count(lengths[:, None], np.arange(world)[None, :], world, interleave)


def blocks_needed(lengths: np.ndarray, block_size: int, world: int) -> np.ndarray:
    """Virtual blocks a request of each length needs."""
    return -(-np.asarray(lengths, dtype=np.int64) // (block_size * world))


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
