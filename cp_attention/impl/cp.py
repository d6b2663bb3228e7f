"""Context-parallel attention impl (PCP, DCP and both).

On top of the single-device plan it adds the data movement:
  * PCP: the step's prefill K/V rows are all-gathered over the PCP group and restored; each
    rank attends its head and tail chunks (unmasked part + causal diagonal, merged by LSE).
    The unmasked part of chunk k attends the first ``k c`` restored keys of each prefill in
    place (``varlen_attention``'s ``seqused_k``), not a gathered copy.
  * cached context (any CP): the query rows are gathered (tokens over PCP when the cache is
    sharded over PCP ranks, heads over DCP), attend this rank's KV shard, and the partials are
    combined exactly over DCP, either all-gather LSE + reduce-scatter of rescaled outputs
    (``dcp_comm_backend="ag_rs"``) or one all-to-all of packed ``[out | lse]`` per head slice
    and a merge (``"a2a"``), then one all-to-all of packed ``[out | lse]`` over PCP and a merge
    of the pcp partials.
"""
from __future__ import annotations

import torch

from cp_attention.comm import Communicator
from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.ops import merge_many

DCP_COMM_BACKENDS = ("ag_rs", "a2a")


class CPAttentionImpl(BaseAttentionImpl):
    """Attention of one layer on one CP rank; ``groups`` is a :class:`CPGroups`."""

    supports_pcp = True
    supports_dcp = True

    def __init__(self, *args, groups=None, dcp_comm_backend: str = "ag_rs", **kwargs) -> None:
        """dcp_comm_backend: how DCP partials are combined, "ag_rs" or "a2a" (see module doc)."""
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
        self.comm = Communicator()

    # -- PCP: gather and restore the step's prefill K/V ------------------------------------
    def _gather_prefill_rows(self, rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Local prefill rows [Lp, ...] of every PCP rank, restored: [pcp * Lp, ...]."""
        gathered = self.comm.all_gather(rows, self.groups.pcp_group)
        return gathered[meta.pcp.pcp_allgather_restore_idx.to(rows.device)]

    def _step_kv(self, key, value, meta):
        if meta.pcp is None or meta.pcp.num_local_rows == 0:
            return key, value
        nd = meta.num_decode_tokens
        local = torch.stack([key[nd:], value[nd:]], dim=1)  # [Lp, 2, Hkv, D]
        gathered, work = self.comm.all_gather_async(local, self.groups.pcp_group)
        return _PendingStepKV(key[:nd], value[:nd], gathered, work,
                              meta.pcp.pcp_allgather_restore_idx.to(key.device))

    def _wait_step_kv(self, handle):
        return handle.wait() if isinstance(handle, _PendingStepKV) else handle

    def _prefill_self_attention(self, q, k, v, step_kv, meta):
        """Head chunk and tail chunk of every prefill, each over the keys before it and its
        causal diagonal; the diagonals need only local rows, so they run while the K/V
        all-gather is in flight."""
        split = meta.pcp
        if split is None or not self.causal:
            return super()._prefill_self_attention(q, k, v, step_kv, meta)
        nd = meta.num_decode_tokens
        q_pre, k_loc, v_loc = q[nd:], k[nd:], v[nd:]
        head, tail = split.chunks  # HeadTail: two chunks per rank
        cu_q = split.chunk_cu_seqlens
        head_q, head_diag = self._chunk_diagonal(q_pre, k_loc, v_loc, head, cu_q)
        tail_q, tail_diag = self._chunk_diagonal(q_pre, k_loc, v_loc, tail, cu_q)
        step_k, step_v = self._wait_step_kv(step_kv)
        k_pre, v_pre = step_k[nd:], step_v[nd:]
        restored_cu = cu_q * (2 * split.pcp_size)  # each prefill's 2 pcp c restored rows
        head_out, head_lse = self._chunk_attention(head_q, k_pre, v_pre, head, cu_q, head_diag,
                                                   restored_cu)
        tail_out, tail_lse = self._chunk_attention(tail_q, k_pre, v_pre, tail, cu_q, tail_diag,
                                                   restored_cu)
        local_order = split.q_full_idx.to(q.device)  # [head rows | tail rows] -> local rows
        return (torch.cat([head_out, tail_out])[local_order],
                torch.cat([head_lse, tail_lse])[local_order])

    def _chunk_diagonal(self, q_pre, k_loc, v_loc, chunk, cu_q):
        """One chunk's queries ``[sum c, H, D]`` and their causal attention over the chunk's
        own (local) rows, ``(out, lse)`` (None with a sliding window: one call does all)."""
        rows = chunk.q_idx.to(q_pre.device)
        q_part = q_pre[rows]
        if self.sliding_window is not None:
            return q_part, None
        return q_part, self.ops.varlen_attention(q_part, k_loc[rows], v_loc[rows], cu_q, cu_q,
                                                 scale=self.scale, causal=True)

    def _chunk_attention(self, q_part, k_pre, v_pre, chunk, cu_q, diagonal, restored_cu):
        """Attention of one chunk's queries ``q_part`` (a :class:`ChunkPlan`'s rows) over the
        restored prefill K/V (``restored_cu``: each prefill's rows): the keys before it merged
        with its ``diagonal``, or with a sliding window one bottom-right causal call over both.
        Both read a prefix of each prefill's restored rows in place (``seqused_k``: ``k c``
        keys before chunk k, ``(k + 1) c`` up to its end), no gathered copy."""
        if self.sliding_window is not None:
            return self.ops.varlen_attention(q_part, k_pre, v_pre, cu_q, restored_cu,
                                             scale=self.scale, causal=True,
                                             window=self.sliding_window,
                                             seqused_k=chunk.cu_seqlens_k.diff())
        before = self.ops.varlen_attention(q_part, k_pre, v_pre, cu_q, restored_cu,
                                           scale=self.scale, causal=False,
                                           seqused_k=chunk.nomask_cu_seqlens_k.diff())
        return self.ops.merge_attn_states(*before, *diagonal)

    # -- cached context ------------------------------------------------------------------
    def _context_queries(self, query, meta):
        if meta.ctx_over_pcp and meta.pcp.num_local_rows:
            nd = meta.num_decode_tokens
            query = torch.cat([query[:nd], self._gather_prefill_rows(query[nd:], meta)])
        return self.comm.all_gather(query, self.groups.dcp_group, dim=1)

    def _combine_context(self, out, lse, meta):
        groups, cfg = self.groups, self.config
        if cfg.dcp_size > 1 and self.dcp_comm_backend == "a2a":
            out, lse = self._combine_dcp_a2a(out, lse)
        elif cfg.dcp_size > 1:
            rows, heads = lse.shape
            all_lse = self.comm.all_gather(lse.float(), groups.dcp_group).view(cfg.dcp_size, rows, heads)
            total = torch.logsumexp(all_lse, dim=0)
            finite = ~torch.isneginf(total)
            weight = torch.where(finite, torch.exp(lse.float() - total), torch.zeros_like(total))
            out = self.comm.reduce_scatter(out * weight.to(out.dtype).unsqueeze(-1),
                                           groups.dcp_group, dim=1)
            mine = slice(groups.ranks.dcp_rank * self.num_heads,
                         (groups.ranks.dcp_rank + 1) * self.num_heads)
            lse = total[:, mine]
        if meta.ctx_over_pcp:
            nd, pcp = meta.num_decode_tokens, cfg.pcp_size
            packed = torch.cat([out, lse.to(out.dtype).unsqueeze(-1)], dim=-1)
            prefill = packed[nd:][meta.pcp.pcp_allgather_scatter_idx.to(out.device)]
            prefill = prefill.view(pcp, -1, *packed.shape[1:])
            send = torch.cat([packed[:nd].unsqueeze(0).expand(pcp, *packed[:nd].shape), prefill], dim=1)
            received = self.comm.all_to_all(send, groups.pcp_group)
            out, lse = merge_many(received[..., :-1], received[..., -1])
        return out, lse

    def _combine_dcp_a2a(self, out, lse):
        """out [rows, dcp * H, D], lse [rows, dcp * H] (every head of the DCP group, this
        rank's KV shard) -> ([rows, H, D], [rows, H]) for this rank's heads, merged over shards:
        one all-to-all of packed ``[out | lse]`` ([dcp, rows, H, D + 1]) then a merge."""
        dcp, rows = self.config.dcp_size, out.shape[0]
        packed = torch.cat([out, lse.to(out.dtype).unsqueeze(-1)], dim=-1)
        send = packed.view(rows, dcp, self.num_heads, -1).transpose(0, 1)
        received = self.comm.all_to_all(send, self.groups.dcp_group)
        return merge_many(received[..., :-1].float(), received[..., -1].float())


class _PendingStepKV:
    """Step K/V whose prefill rows are still being all-gathered over the PCP group."""

    def __init__(self, decode_k, decode_v, gathered, work, restore_idx) -> None:
        self._parts = (decode_k, decode_v, gathered, work, restore_idx)
        self._result: tuple[torch.Tensor, torch.Tensor] | None = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[step rows, Hkv, D] keys and values: decode rows, then restored prefill rows."""
        if self._result is None:
            decode_k, decode_v, gathered, work, restore_idx = self._parts
            if work is not None:
                work.wait()
            kv = gathered[restore_idx]
            if decode_k.shape[0]:
                self._result = (torch.cat([decode_k, kv[:, 0]]), torch.cat([decode_v, kv[:, 1]]))
            else:  # prefill-only step: no copy
                self._result = (kv[:, 0], kv[:, 1])
            self._parts = None
        return self._result

