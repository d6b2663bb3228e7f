"""Context-parallel attention impl (PCP, DCP and both).

On top of the single-device plan it adds the data movement:
  * PCP: the step's prefill K/V rows are all-gathered over the PCP group and restored; each
    rank attends its head and tail chunks (unmasked part + causal diagonal, merged by LSE).
  * cached context (any CP): the query rows are gathered (tokens over PCP when the cache is
    sharded over PCP ranks, heads over DCP), attend this rank's KV shard, and the partials are
    combined exactly: all-gather LSE + reduce-scatter of rescaled outputs over DCP, then one
    all-to-all of packed ``[out | lse]`` over PCP and a merge of the pcp partials.
"""
from __future__ import annotations

import numpy as np
import torch

from cp_attention.comm import Communicator
from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.ops import merge_many


class CPAttentionImpl(BaseAttentionImpl):
    """Attention of one layer on one CP rank; ``groups`` is a :class:`CPGroups`."""

    supports_pcp = True
    supports_dcp = True

    def __init__(self, *args, groups=None, **kwargs) -> None:
        if groups is None:
            raise ValueError("CPAttentionImpl needs groups (CPGroups.create(config))")
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
        kv = self._gather_prefill_rows(torch.stack([key[nd:], value[nd:]], dim=1), meta)
        return torch.cat([key[:nd], kv[:, 0]]), torch.cat([value[:nd], kv[:, 1]])

    def _prefill_self_attention(self, q, step_k, step_v, meta):
        split = meta.pcp
        if split is None or not self.causal:
            return super()._prefill_self_attention(q, step_k, step_v, meta)
        nd = meta.num_decode_tokens
        q_pre, k_pre, v_pre = q[nd:], step_k[nd:], step_v[nd:]
        device = q.device
        cu_q = _cumsum0(split.attn_mask_seqlens[0])
        parts = []
        for q_idx, nomask_idx, mask_idx, full_idx, nomask_lens, chunk in (
                (split.q_head_idx, split.kv_with_q_head_nomask_idx, split.kv_with_q_head_mask_idx,
                 split.kv_with_q_head_idx, split.head_attn_nomask_seqlens, split.pcp_rank),
                (split.q_tail_idx, split.kv_with_q_tail_nomask_idx, split.kv_with_q_tail_mask_idx,
                 split.kv_with_q_tail_idx, split.tail_attn_nomask_seqlens,
                 2 * split.pcp_size - 1 - split.pcp_rank)):
            q_part = q_pre[q_idx.to(device)]
            if self.sliding_window is not None:
                full_idx = full_idx.to(device)
                cu_k = _cumsum0(torch.from_numpy((chunk + 1) * split.chunk_lens))
                parts.append(self.ops.varlen_attention(
                    q_part, k_pre[full_idx], v_pre[full_idx], cu_q, cu_k, scale=self.scale,
                    causal=True, window=self.sliding_window))
                continue
            mask_idx, nomask_idx = mask_idx.to(device), nomask_idx.to(device)
            diag = self.ops.varlen_attention(q_part, k_pre[mask_idx], v_pre[mask_idx], cu_q, cu_q,
                                             scale=self.scale, causal=True)
            before = self.ops.varlen_attention(q_part, k_pre[nomask_idx], v_pre[nomask_idx], cu_q,
                                               _cumsum0(nomask_lens[1]), scale=self.scale,
                                               causal=False)
            parts.append(self.ops.merge_attn_states(*before, *diag))
        order = split.q_full_idx.to(device)
        out = torch.cat([parts[0][0], parts[1][0]])[order]
        lse = torch.cat([parts[0][1], parts[1][1]])[order]
        return out, lse

    # -- cached context ------------------------------------------------------------------
    def _context_queries(self, query, meta):
        if meta.ctx_over_pcp and meta.pcp.num_local_rows:
            nd = meta.num_decode_tokens
            query = torch.cat([query[:nd], self._gather_prefill_rows(query[nd:], meta)])
        return self.comm.all_gather(query, self.groups.dcp_group, dim=1)

    def _combine_context(self, out, lse, meta):
        groups, cfg = self.groups, self.config
        if cfg.dcp_size > 1:
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


def _cumsum0(lengths: torch.Tensor) -> torch.Tensor:
    lengths = torch.as_tensor(np.asarray(lengths), dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
