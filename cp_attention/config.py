"""CPConfig and CPRanks: the parallel sizes, KV-cache layout and one rank's coordinates.

Pure data (no process groups): the metadata planners depend on this module only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KV_SHARD_POLICIES = ("cp", "dcp")
WINDOW_CACHES = ("all", "window")


def is_int(value) -> bool:
    """A Python or numpy integer (bools rejected)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class CPConfig:
    """Sizes and KV layout, validated on construction (``ValueError`` names field and rule).

    World layout (as vLLM): ``world = pcp_size * tp_size``, ``rank = pcp_rank * tp_size + tp_rank``;
    DCP groups are ``dcp_size`` consecutive ranks of a TP group (``dcp_rank = tp_rank % dcp_size``).

    The KV group: the ranks that shard one request's KV (``kv_world``, shard ``kv_rank``;
    vLLM's DCP group). kv_shard picks it: "cp" all ``pcp*dcp`` ranks, "dcp" the DCP group only
    (every PCP rank keeping the whole sequence of its shard). Our DCP group: the ``dcp_size``
    TP ranks that share a KV head and split its query heads.
    decode_threshold: a request with context and at most this many new tokens is a decode
    (1 + number of speculative tokens).
    window_cache: what a sliding-window layer's PCP prefill writes to the cache: "all" every
    token of the shard (a prefix-cache hit may read any), "window" only each prefill's last
    ``window - 1`` tokens, all that a later step of the same request reads (for deployments
    without prefix caching; the PCP exchange then moves only the windows' halos).
    """

    pcp_size: int = 1
    dcp_size: int = 1
    tp_size: int = 1
    block_size: int = 16
    cp_kv_interleave_size: int = 1
    kv_shard: str = "cp"
    decode_threshold: int = 1
    window_cache: str = "all"

    def __post_init__(self) -> None:
        for name in ("pcp_size", "dcp_size", "tp_size", "block_size", "cp_kv_interleave_size",
                     "decode_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tp_size % self.dcp_size:
            raise ValueError(f"tp_size ({self.tp_size}) must be divisible by dcp_size "
                             f"({self.dcp_size}): DCP groups live inside the TP group")
        if self.block_size % self.cp_kv_interleave_size:
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of "
                             f"cp_kv_interleave_size ({self.cp_kv_interleave_size})")
        if self.kv_shard not in KV_SHARD_POLICIES:
            raise ValueError(f"kv_shard must be one of {KV_SHARD_POLICIES}, got {self.kv_shard!r}")
        if self.window_cache not in WINDOW_CACHES:
            raise ValueError(f"window_cache must be one of {WINDOW_CACHES}, got "
                             f"{self.window_cache!r}")

    @property
    def world_size(self) -> int:
        return self.pcp_size * self.tp_size

    @property
    def cp_world(self) -> int:
        """Ranks that share one request's computation: pcp_size * dcp_size."""
        return self.pcp_size * self.dcp_size

    @property
    def kv_world(self) -> int:
        """Size of the KV group: shards of each request's KV cache."""
        return self.cp_world if self.kv_shard == "cp" else self.dcp_size

    @property
    def uses_cp(self) -> bool:
        return self.pcp_size > 1 or self.dcp_size > 1

    def kv_rank(self, pcp_rank: int, dcp_rank: int) -> int:
        """This rank's KV shard: its index in the KV group (``pcp_rank * dcp_size + dcp_rank``
        for "cp", ``dcp_rank`` for "dcp")."""
        return pcp_rank * self.dcp_size + dcp_rank if self.kv_shard == "cp" else dcp_rank

    def validate_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Check a model's head counts against tp/dcp (vLLM's GQA rules for DCP).

        vLLM's third rule, ``(num_heads / num_kv_heads) % dcp_size == 0``, follows from the
        ones checked here (num_heads % tp_size == 0 and tp_size // num_kv_heads a multiple of
        dcp_size), so it needs no check of its own.
        """
        if num_heads < 1 or num_kv_heads < 1:
            raise ValueError(f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) must be >= 1")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if num_heads % self.tp_size:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by tp_size ({self.tp_size})")
        if num_kv_heads >= self.tp_size:
            if num_kv_heads % self.tp_size:
                raise ValueError(f"num_kv_heads ({num_kv_heads}) must be divisible by tp_size "
                                 f"({self.tp_size}) when it is not smaller")
        elif self.tp_size % num_kv_heads:
            raise ValueError(f"tp_size ({self.tp_size}) must be divisible by num_kv_heads "
                             f"({num_kv_heads}) when KV heads are replicated")
        if self.dcp_size > 1:
            replicas = self.tp_size // num_kv_heads
            if replicas < self.dcp_size or replicas % self.dcp_size:
                raise ValueError(
                    f"dcp_size ({self.dcp_size}) needs each KV head replicated on a multiple of "
                    f"dcp_size TP ranks: tp_size // num_kv_heads = {self.tp_size} // {num_kv_heads}"
                    f" = {replicas} must be >= dcp_size and divisible by it")


@dataclass(frozen=True)
class CPRanks:
    """This process's coordinates in a :class:`CPConfig` deployment (pure data)."""

    pcp_rank: int = 0
    tp_rank: int = 0
    dcp_rank: int = 0

    @classmethod
    def of(cls, config: CPConfig, rank: int) -> "CPRanks":
        """Coordinates of global ``rank`` (``rank = pcp_rank * tp_size + tp_rank``)."""
        if not is_int(rank):
            raise ValueError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < config.world_size:
            raise ValueError(f"rank ({rank}) must be in [0, world_size={config.world_size})")
        pcp_rank, tp_rank = divmod(int(rank), config.tp_size)
        return cls(pcp_rank, tp_rank, tp_rank % config.dcp_size)


def heads_of_rank(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int
                  ) -> tuple[range, range]:
    """Query heads and KV heads held by a TP rank (KV heads replicated when fewer than tp)."""
    q_per_rank = num_heads // tp_size
    q_heads = range(tp_rank * q_per_rank, (tp_rank + 1) * q_per_rank)
    if num_kv_heads >= tp_size:
        kv_per_rank = num_kv_heads // tp_size
        return q_heads, range(tp_rank * kv_per_rank, (tp_rank + 1) * kv_per_rank)
    kv_head = tp_rank // (tp_size // num_kv_heads)
    return q_heads, range(kv_head, kv_head + 1)
