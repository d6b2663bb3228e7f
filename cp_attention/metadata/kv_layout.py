"""Which KV shard stores which cached token, and where (pure index math, docs/dcp.md section 1):
:class:`KVSharding`, the one definition the builder, the step checks, the vLLM slot-mapping
shim and the test oracles read."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_attention.config import CPConfig
from cp_attention.metadata.common import ranges_concat


@dataclass(frozen=True)
class KVSharding:
    """Interleaved ownership of each request's tokens over ``world`` KV shards.

    Token ``t`` is owned by shard ``(t // I) % W`` (``I`` = ``interleave``, ``W`` = ``world``)
    at local position ``(t // (I * W)) * I + t % I``. Block tables count virtual blocks of
    ``block_size * W`` tokens; virtual block ``b`` is the physical block ``b`` of every shard,
    so a token's slot is ``table[req, local // block_size] * block_size + local % block_size``.
    Positions and lengths are int64 arrays of any shape.
    """

    world: int
    interleave: int = 1
    block_size: int = 16

    @classmethod
    def of(cls, config: CPConfig) -> KVSharding:
        """The sharding of ``config`` (its ``kv_world`` shards)."""
        return cls(config.kv_world, config.cp_kv_interleave_size, config.block_size)

    def owner(self, positions: np.ndarray) -> np.ndarray:
        """KV shard that stores each token position."""
        return (np.asarray(positions) // self.interleave) % self.world

    def local_position(self, positions: np.ndarray) -> np.ndarray:
        """Position of each token inside its owner's local sequence."""
        positions, inter = np.asarray(positions), self.interleave
        return (positions // (inter * self.world)) * inter + positions % inter

    def local_count(self, lengths: np.ndarray, shard: int | np.ndarray) -> np.ndarray:
        """Tokens among positions ``[0, L)`` owned by ``shard``, for each length L (vectorized).

        With ``L' = L - shard * I``: ``I`` per whole period of ``I * W`` tokens in ``L'``, plus
        ``min(L' mod I W, I)`` (floor division makes ``L' < 0`` count 0). With ``I = 1`` that is
        ``ceil(L' / W)``, written as one floor division (numpy's ``divmod`` costs ~3x as much).
        """
        world, inter = self.world, self.interleave
        if inter == 1:
            return (np.asarray(lengths, dtype=np.int64) + (world - 1 - np.asarray(shard))) // world
        periods, rem = np.divmod(np.asarray(lengths, dtype=np.int64) - np.asarray(shard) * inter,
                                 inter * world)
        return periods * inter + np.minimum(rem, inter)

    def blocks_needed(self, lengths: np.ndarray) -> np.ndarray:
        """Virtual blocks a request of each length needs."""
        per_block = self.block_size * self.world
        return (np.asarray(lengths, dtype=np.int64) + (per_block - 1)) // per_block

    def slots(self, req: np.ndarray, positions: np.ndarray, block_table: np.ndarray,
              shard: int) -> np.ndarray:
        """[T] int64 cache slot of each token on ``shard``, -1 where another shard owns it or
        ``req < 0``. req, positions: [T] request (row of block_table) and global position."""
        req = np.asarray(req, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        owned = (req >= 0) & (self.owner(positions) == shard)
        slots = np.full(len(positions), -1, dtype=np.int64)
        if owned.any():
            loc = self.local_position(positions[owned])
            slots[owned] = (block_table[req[owned], loc // self.block_size].astype(np.int64)
                            * self.block_size + loc % self.block_size)
        return slots

    def segment_slots(self, req: np.ndarray, first_row: np.ndarray, first_pos: np.ndarray,
                      num_tokens: np.ndarray, num_rows: int, block_table: np.ndarray,
                      shard: int) -> np.ndarray:
        """[num_rows] int64 :meth:`slots` of rows given as segments, -1 where nothing is stored.

        Segment k holds request ``req[k]``'s tokens at global positions ``first_pos[k] .. +
        num_tokens[k]`` in rows ``first_row[k] .. + num_tokens[k]`` (rows not covered, e.g.
        pads, get -1). All inputs [S] int64. Closed form per segment: the shard's tokens of a
        segment are the local positions ``[local_count(first_pos), local_count(first_pos +
        num_tokens))``, so the work is proportional to the tokens this shard stores, not to
        every row. Equals :meth:`slots` over the rows (tested).
        """
        world, inter, block_size = self.world, self.interleave, self.block_size
        slots = np.full(num_rows, -1, dtype=np.int64)
        # [2, S] local positions [lo, hi) of each segment's tokens held by this shard
        lo, hi = self.local_count(np.array((first_pos, first_pos + num_tokens)), shard)
        owned = hi - lo
        local = ranges_concat(lo, owned)  # local positions stored here, segment by segment
        if len(local) == 0:
            return slots
        if inter == 1:  # global position = local * world + shard
            rows = local * world
        else:
            rows = (local // inter) * (inter * world) + local % inter
        rows += (first_row - first_pos + shard * inter).repeat(owned)
        block = local // block_size
        # table[req, block] * block_size + local % block_size, without the (slow) remainder
        slot = block_table.ravel()[block + (req * block_table.shape[1]).repeat(owned)] - block
        slot *= block_size
        slot += local
        slots[rows] = slot
        return slots
