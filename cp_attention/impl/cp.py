"""Context-parallel attention impl (PCP, DCP and both): the CP constructor checks. The
forward is :class:`~cp_attention.impl.base.BaseAttentionImpl`'s, the same steps over groups of
more than one rank (:mod:`~cp_attention.impl.self_part`, :mod:`~cp_attention.impl.context`)."""
from __future__ import annotations

from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.impl.context import DCP_COMM_BACKENDS


class CPAttentionImpl(BaseAttentionImpl):
    """Attention of one layer on one CP rank; ``groups`` is a :class:`CPGroups`."""

    def __init__(self, *args, groups=None, dcp_comm_backend: str = "ag_rs", **kwargs) -> None:
        """dcp_comm_backend: how DCP partials are combined, "ag_rs" (all-gather LSE +
        reduce-scatter) or "a2a" (one all-to-all of packed ``[out | lse]``)."""
        if groups is None:
            raise ValueError("CPAttentionImpl needs groups (CPGroups.create(config, device))")
        if dcp_comm_backend not in DCP_COMM_BACKENDS:
            raise ValueError(f"dcp_comm_backend must be one of {DCP_COMM_BACKENDS}, "
                             f"got {dcp_comm_backend!r}")
        self.dcp_comm_backend = dcp_comm_backend
        super().__init__(*args, groups=groups, **kwargs)
        self.config = groups.config
        if self.config.dcp_size > 1 and self.num_kv_heads != 1:
            raise ValueError(
                f"dcp_size ({self.config.dcp_size}) > 1 needs one (replicated) KV head per rank, "
                f"got num_kv_heads={self.num_kv_heads} on this rank: the ranks of a DCP group "
                "must share their KV head (tp_size // total KV heads a multiple of dcp_size); "
                "see CPConfig.validate_heads")
