"""The collectives of one layer's forward, each a function (identity for a group of one).

Gathers: the step's prefill K/V over PCP (:func:`gather_step_kv`, asynchronous) and the
context queries (:func:`gather_context_queries`: prefill rows over PCP when the cache is
sharded over PCP ranks, heads over DCP). Combines of the context partials, exact by LSE:
over DCP either all-gather LSE + reduce-scatter of rescaled outputs (:func:`combine_dcp_ag_rs`)
or one all-to-all of packed ``[out | lse]`` per head slice and a merge (:func:`combine_dcp_a2a`);
then over PCP one all-to-all of packed ``[out | lse]`` and a merge (:func:`combine_pcp_a2a`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cp_attention.comm import Communicator
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.ops import merge_many

DCP_COMM_BACKENDS = ("ag_rs", "a2a")
Group = dist.ProcessGroup | None


class StepKV:
    """The step rows' K/V, ``[step rows, Hkv, D]`` each: the layer's own rows, or (PCP) the
    decode rows and every rank's prefill rows, restored, once the all-gather has arrived."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, gathered=None, work=None,
                 restore_idx: torch.Tensor | None = None) -> None:
        self._parts = (key, value, gathered, work, restore_idx)
        self._result = (key, value) if gathered is None else None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values): decode rows, then the restored prefill rows."""
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


def gather_step_kv(comm: Communicator, key: torch.Tensor, value: torch.Tensor,
                   meta: AttentionMetadata, pcp_group: Group) -> StepKV:
    """Start the all-gather of the local prefill K/V rows (``[Lp, Hkv, D]`` each) over PCP;
    without PCP prefill rows the step rows are the layer's own."""
    split, nd = meta.pcp, meta.num_decode_tokens
    if split is None or split.num_local_rows == 0:
        return StepKV(key, value)
    local = torch.stack([key[nd:], value[nd:]], dim=1)  # [Lp, 2, Hkv, D]
    gathered, work = comm.all_gather_async(local, pcp_group)
    return StepKV(key[:nd], value[:nd], gathered, work,
                  split.pcp_allgather_restore_idx.to(key.device))


def gather_context_queries(comm: Communicator, query: torch.Tensor, meta: AttentionMetadata,
                           pcp_group: Group, dcp_group: Group) -> torch.Tensor:
    """query [rows, H, D] -> the context rows' queries [context rows, dcp H, D]: prefill rows
    of every PCP rank, restored, when the context rows are the step rows; heads over DCP."""
    if meta.ctx_over_pcp and meta.pcp.num_local_rows:
        nd = meta.num_decode_tokens
        gathered = comm.all_gather(query[nd:], pcp_group)
        restore = meta.pcp.pcp_allgather_restore_idx.to(query.device)
        query = torch.cat([query[:nd], gathered[restore]])
    return comm.all_gather(query, dcp_group, dim=1)


def combine_dcp_ag_rs(comm: Communicator, out: torch.Tensor, lse: torch.Tensor,
                      dcp_group: Group, dcp_size: int, dcp_rank: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """out [rows, dcp H, D], lse [rows, dcp H] (every head of the DCP group over this rank's
    KV shard) -> ([rows, H, D], [rows, H]) of this rank's heads over every shard: all-gather
    of the LSEs, then a reduce-scatter of the outputs rescaled by ``exp(lse - total)``."""
    rows, heads = lse.shape
    all_lse = comm.all_gather(lse.float(), dcp_group).view(dcp_size, rows, heads)
    total = torch.logsumexp(all_lse, dim=0)
    finite = ~torch.isneginf(total)
    weight = torch.where(finite, torch.exp(lse.float() - total), torch.zeros_like(total))
    out = comm.reduce_scatter(out * weight.to(out.dtype).unsqueeze(-1), dcp_group, dim=1)
    mine = heads // dcp_size
    return out, total[:, dcp_rank * mine:(dcp_rank + 1) * mine]


def combine_dcp_a2a(comm: Communicator, out: torch.Tensor, lse: torch.Tensor,
                    dcp_group: Group, dcp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`combine_dcp_ag_rs`, by one all-to-all of packed ``[out | lse]``
    ([dcp, rows, H, D + 1]) and a merge of the dcp partials of this rank's heads."""
    rows = out.shape[0]
    packed = torch.cat([out, lse.to(out.dtype).unsqueeze(-1)], dim=-1)
    send = packed.view(rows, dcp_size, out.shape[1] // dcp_size, -1).transpose(0, 1)
    received = comm.all_to_all(send, dcp_group)
    return merge_many(received[..., :-1].float(), received[..., -1].float())


def combine_pcp_a2a(comm: Communicator, out: torch.Tensor, lse: torch.Tensor,
                    meta: AttentionMetadata, pcp_group: Group
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of the context rows (step rows: decodes, then every rank's restored prefill
    rows) over this rank's shard -> ([rows, H, D], [rows, H]) of the local rows over every
    PCP shard: each rank is sent its rows of packed ``[out | lse]`` (decode rows to all, the
    prefill rows scattered back to their rank), then a merge of the pcp partials."""
    nd, pcp = meta.num_decode_tokens, meta.pcp.pcp_size
    packed = torch.cat([out, lse.to(out.dtype).unsqueeze(-1)], dim=-1)
    prefill = packed[nd:][meta.pcp.pcp_allgather_scatter_idx.to(out.device)]
    prefill = prefill.view(pcp, -1, *packed.shape[1:])
    send = torch.cat([packed[:nd].unsqueeze(0).expand(pcp, *packed[:nd].shape), prefill], dim=1)
    received = comm.all_to_all(send, pcp_group)
    return merge_many(received[..., :-1], received[..., -1])
