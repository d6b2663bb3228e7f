"""Steps 4 and 5 of the forward, the context part: the context rows' queries over this rank's
KV shard, then the shards' partials combined exactly (LSE). Each collective is a function and
a no-op for a group of one: the gather of the context queries and the three combines, DCP
ag_rs, DCP a2a and the PCP all-to-all."""
from __future__ import annotations

import torch
import torch.distributed as dist

from cp_attention.comm import Communicator, group_rank, group_size
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.ops import AttentionOps, merge_many

DCP_COMM_BACKENDS = ("ag_rs", "a2a")
Group = dist.ProcessGroup | None
Partial = tuple[torch.Tensor, torch.Tensor]  # (out [rows, Hq, D], lse [rows, Hq])


def context_attention(ops: AttentionOps, comm: Communicator, q: torch.Tensor,
                      key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, pcp_group: Group, dcp_group: Group,
                      dcp_comm_backend: str, scale: float) -> Partial:
    """The local rows q [rows, Hq, D] over their requests' cached context on every KV shard."""
    ctx_q = gather_context_queries(comm, q, meta, pcp_group, dcp_group)
    out, lse = ops.paged_attention(ctx_q, key_cache, value_cache, meta.ctx_block_table,
                                   meta.ctx_cu_seqlens, meta.ctx_seq_lens, scale=scale,
                                   kv_start=meta.ctx_kv_start, kv_end=meta.ctx_kv_end)
    return combine(ops, comm, out, lse, meta, pcp_group, dcp_group, dcp_comm_backend)


def single_pass_attention(ops: AttentionOps, comm: Communicator, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, meta: AttentionMetadata, pcp_group: Group,
                          dcp_group: Group, dcp_comm_backend: str, scale: float) -> torch.Tensor:
    """Decode-only steps (``meta.single_pass``): write the step's K/V, then one paged call over
    this rank's shard, which holds them (no self part), combined over the shards: out
    [rows, Hq, D]."""
    ctx_q = gather_context_queries(comm, q, meta, pcp_group, dcp_group)
    out, lse = ops.cache_and_paged_attention(
        ctx_q, k, v, key_cache, value_cache, meta.step_slot_mapping, meta.ctx_block_table,
        meta.ctx_cu_seqlens, meta.single_pass_seq_lens, scale=scale,
        kv_start=meta.single_pass_kv_start, kv_end=meta.single_pass_kv_end)
    return combine(ops, comm, out, lse, meta, pcp_group, dcp_group, dcp_comm_backend)[0]


def combine(ops: AttentionOps, comm: Communicator, out: torch.Tensor, lse: torch.Tensor,
            meta: AttentionMetadata, pcp_group: Group, dcp_group: Group,
            dcp_comm_backend: str) -> Partial:
    """Partials over this rank's KV shard (out [context rows, dcp Hq, D], lse) -> the context
    attention of the local rows over every shard: over DCP (``dcp_comm_backend``), then over
    PCP. Identity on one rank."""
    combine_dcp = combine_dcp_a2a if dcp_comm_backend == "a2a" else combine_dcp_ag_rs
    out, lse = combine_dcp(comm, out, lse, dcp_group)
    return combine_pcp_a2a(ops, comm, out, lse, meta, pcp_group)


def gather_context_queries(comm: Communicator, query: torch.Tensor, meta: AttentionMetadata,
                           pcp_group: Group, dcp_group: Group) -> torch.Tensor:
    """query [rows, H, D] -> the context rows' queries [context rows, dcp H, D]: prefill rows
    of every PCP rank, restored, when the context rows are the step rows; heads over DCP."""
    if meta.ctx_over_pcp and meta.num_local_prefill_rows:
        nd = meta.num_decode_tokens
        gathered = comm.all_gather(query[nd:], pcp_group)
        restore = meta.pcp_allgather_restore_idx.to(query.device)
        query = torch.cat([query[:nd], gathered.index_select(0, restore)])
    return comm.all_gather(query, dcp_group, dim=1)


def combine_dcp_ag_rs(comm: Communicator, out: torch.Tensor, lse: torch.Tensor,
                      dcp_group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """out [rows, dcp H, D], lse [rows, dcp H] (every head of the DCP group over this rank's
    KV shard) -> ([rows, H, D], [rows, H]) of this rank's heads over every shard: all-gather
    of the LSEs, then a reduce-scatter of the outputs rescaled by ``exp(lse - total)``."""
    dcp = group_size(dcp_group)
    if dcp == 1:
        return out, lse
    rows, heads = lse.shape
    all_lse = comm.all_gather(lse.float(), dcp_group).view(dcp, rows, heads)
    total = torch.logsumexp(all_lse, dim=0)
    finite = ~torch.isneginf(total)
    weight = torch.where(finite, torch.exp(lse.float() - total), torch.zeros_like(total))
    out = comm.reduce_scatter(out * weight.to(out.dtype).unsqueeze(-1), dcp_group, dim=1)
    return out, total.chunk(dcp, dim=1)[group_rank(dcp_group)]


def combine_dcp_a2a(comm: Communicator, out: torch.Tensor, lse: torch.Tensor,
                    dcp_group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`combine_dcp_ag_rs`, by one all-to-all of packed ``[out | lse]``
    ([dcp, rows, H, D + 1]) and a merge of the dcp partials of this rank's heads."""
    dcp = group_size(dcp_group)
    if dcp == 1:
        return out, lse
    packed = torch.cat([out, lse.to(out.dtype).unsqueeze(-1)], dim=-1)
    send = packed.view(out.shape[0], dcp, out.shape[1] // dcp, -1).transpose(0, 1)
    received = comm.all_to_all(send, dcp_group)
    return merge_many(received[..., :-1].float(), received[..., -1].float())


def combine_pcp_a2a(ops: AttentionOps, comm: Communicator, out: torch.Tensor,
                    lse: torch.Tensor, meta: AttentionMetadata, pcp_group: Group
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of the context rows (step rows: decodes, then every rank's restored prefill
    rows) over this rank's shard -> ([rows, H, D], [rows, H]) of the local rows over every
    PCP shard: each rank is sent its rows of packed ``[out | lse]`` (decode rows to all, the
    prefill rows scattered back to their rank), then a merge of the pcp partials; with no
    prefill row every rank is sent the same rows, so an all-gather does (the same bytes, and
    the collective :class:`Communicator` may run in shared memory). Identity when the context
    rows are the local rows."""
    if not meta.ctx_over_pcp:
        return out, lse
    nd, pcp = meta.num_decode_tokens, meta.pcp_size
    packed = torch.cat([out, lse.to(out.dtype).unsqueeze(-1)], dim=-1)
    if not meta.num_local_prefill_rows:  # the same on every rank (equal chunks)
        received = comm.all_gather(packed, pcp_group).view(pcp, *packed.shape)
        return merge_partials(ops, received[..., :-1], received[..., -1])
    prefill = packed[nd:].index_select(0, meta.pcp_allgather_scatter_idx.to(out.device))
    prefill = prefill.view(pcp, -1, *packed.shape[1:])
    send = torch.cat([packed[:nd].unsqueeze(0).expand(pcp, *packed[:nd].shape), prefill], dim=1)
    received = comm.all_to_all(send, pcp_group)
    return merge_partials(ops, received[..., :-1], received[..., -1])


def merge_partials(ops: AttentionOps, outs: torch.Tensor, lses: torch.Tensor) -> Partial:
    """outs [N, rows, H, D], lses [N, rows, H] -> the merged (out, lse): two parts by the ops'
    one-pass merge (decode steps at pcp=2: one C++ call on CPU instead of about ten torch
    ops), more by :func:`merge_many`."""
    if outs.shape[0] == 2:
        return ops.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    return merge_many(outs, lses)
