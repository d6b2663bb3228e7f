"""Steps 1 and 2 of the forward, the self part: every local row over the step's own new tokens.

Under PCP the step's prefill K/V are all-gathered over the PCP group while each rank's head and
tail chunks attend their causal diagonals on local rows (HeadTail, docs/pcp.md section 2); the
step rows' K/V come back for the cache write. A sliding-window layer exchanges only its chunks'
halos and the rows its shard writes (:mod:`~cp_attention.metadata.window`). Without PCP it is
one causal varlen call."""
from __future__ import annotations

import torch
import torch.distributed as dist

from cp_attention.comm import Communicator
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.ops import AttentionOps

Partial = tuple[torch.Tensor, torch.Tensor]  # (out [rows, Hq, D], lse [rows, Hq])


def self_attention(ops: AttentionOps, comm: Communicator, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, meta: AttentionMetadata, pcp_group: dist.ProcessGroup | None,
                   scale: float, causal: bool, window: int | None
                   ) -> tuple[Partial, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Local rows q [rows, Hq, D] (k, v [rows, Hkv, D]) over the step's own new tokens: decode
    rows over their own, prefill rows (PCP: head and tail chunks) over their prefill's
    (``causal``; encoder-only: every real token). Returns the partial and what the cache
    write takes: K/V ``[rows to write, Hkv, D]`` each and their slots (the step rows: decode
    rows, then the prefill rows, restored under PCP; with a window exchange, the decode rows
    and the prefill rows this shard writes)."""
    nd = meta.num_decode_tokens
    gather = meta.pcp_partition is not None and meta.num_local_prefill_rows > 0
    if gather:  # 1. the all-gather of the local prefill rows, in flight during 2
        local = torch.stack([k[nd:], v[nd:]], dim=1)  # [Lp, 2, Hkv, D]
        if meta.window_send_idx is not None:  # only the rows other ranks' windows need
            return _window_exchange(ops, comm, q, k, v, local, meta, pcp_group, scale, window)
        gathered, work = comm.all_gather_async(local, pcp_group)
    if nd == q.shape[0]:  # decode rows only: nothing gathered
        return (_causal(ops, q, k, v, meta.decode_cu_seqlens, scale, window),
                (k, v, meta.step_slot_mapping))
    dec = _causal(ops, q[:nd], k[:nd], v[:nd], meta.decode_cu_seqlens, scale, window) if nd else None
    q_pre, k_pre, v_pre = q[nd:], k[nd:], v[nd:]
    diagonal = None
    if gather and causal:  # every chunk's diagonal while the gather flies:
        cu = meta.local_chunk_cu_seqlens  # one causal call over the local rows in place
        diagonal = ops.varlen_attention(q_pre, k_pre, v_pre, cu, cu, scale=scale, causal=True)
    step_k, step_v = k, v
    if gather:  # the step rows [nd + restored, 2, Hkv, D]: decodes, then the gathered rows
        if work is not None:  # restored in request order (one copy, no concatenation)
            work.wait()
        step_kv = gathered.new_empty((nd + gathered.shape[0],) + gathered.shape[1:])
        step_kv[:nd, 0], step_kv[:nd, 1] = k[:nd], v[:nd]
        torch.index_select(gathered, 0, meta.pcp_allgather_restore_idx.to(k.device),
                           out=step_kv[nd:])
        del local, gathered, work  # the all-gather's buffers (which its work holds too): not
                                   # read again, freed before the unmasked part
        step_k, step_v = step_kv[:, 0], step_kv[:, 1]
    if gather and causal:
        pre = pcp_prefill_attention(ops, q_pre, step_k[nd:], step_v[nd:], meta, diagonal,
                                    scale)
    elif causal:
        pre = _causal(ops, q_pre, k_pre, v_pre, meta.prefill_cu_seqlens, scale, window)
    else:  # encoder-only: over the real tokens of each prefill
        real = meta.prefill_real_kv_idx
        pre = ops.varlen_attention(q_pre, step_k[real], step_v[real], meta.prefill_cu_seqlens,
                                   meta.prefill_real_cu_seqlens, scale=scale, causal=False)
    return _with_decodes(dec, pre), (step_k, step_v, meta.step_slot_mapping)


def _with_decodes(dec: Partial | None, pre: Partial) -> Partial:
    """The decode rows' partial (None: no decode rows), then the prefill rows'."""
    return pre if dec is None else (torch.cat([dec[0], pre[0]]), torch.cat([dec[1], pre[1]]))


def _window_exchange(ops: AttentionOps, comm: Communicator, q, k, v, local: torch.Tensor,
                     meta: AttentionMetadata, pcp_group: dist.ProcessGroup | None,
                     scale: float, window: int
                     ) -> tuple[Partial, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The self part of a sliding-window layer under PCP: each local chunk over its halo and
    itself in one bottom-right causal windowed call, on the rows the window exchange brings
    (``local`` [Lp, 2, Hkv, D]: this rank's prefill K/V)."""
    nd = meta.num_decode_tokens
    send = local.index_select(0, meta.window_send_idx.to(local.device))
    work = None
    if send.shape[0]:  # the same on every rank (the plan is)
        gathered, work = comm.all_gather_async(send, pcp_group)
    dec = _causal(ops, q[:nd], k[:nd], v[:nd], meta.decode_cu_seqlens, scale, window) if nd else None
    if work is not None:
        work.wait()
    source = torch.cat([local, gathered]) if send.shape[0] else local  # [Lp + pcp S, ...]
    keys = source.index_select(0, meta.window_key_idx.to(local.device))
    pre = ops.varlen_attention(q[nd:], keys[:, 0], keys[:, 1], meta.local_chunk_cu_seqlens,
                               meta.window_key_cu_seqlens, scale=scale, causal=True,
                               window=window)
    written = source.index_select(0, meta.window_write_idx.to(local.device))
    slots = torch.cat([meta.step_slot_mapping[:nd], meta.window_write_slots])
    return _with_decodes(dec, pre), (torch.cat([k[:nd], written[:, 0]]),
                                     torch.cat([v[:nd], written[:, 1]]), slots)


def _causal(ops: AttentionOps, q, k, v, cu_seqlens, scale: float, window: int | None) -> Partial:
    """Causal (windowed) attention of rows over their own request's rows."""
    return ops.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, scale=scale, causal=True,
                                window=window)


def pcp_prefill_attention(ops: AttentionOps, q_pre: torch.Tensor, k_pre: torch.Tensor,
                          v_pre: torch.Tensor, meta: AttentionMetadata, diagonal: Partial,
                          scale: float) -> Partial:
    """Local prefill rows q_pre [Lp, Hq, D] over each prefill's tokens up to their own;
    k_pre, v_pre: the restored prefill rows; ``diagonal``: every chunk's causal part, on the
    local rows. Returns out [Lp, Hq, D], lse [Lp, Hq] in local order: each chunk's rows over
    the keys before it, written to their local rows, merged with the diagonal."""
    cu_q = meta.chunk_cu_seqlens
    restored_cu = cu_q * meta.pcp_partition.num_chunks  # each prefill's restored (padded) rows
    out = lse = None
    for rows, before in zip(meta.chunk_q_idx.to(q_pre.device), meta.chunk_keys_before):
        part_out, part_lse = chunk_attention(ops, q_pre.index_select(0, rows), k_pre, v_pre,
                                             cu_q, restored_cu, before, scale)
        if out is None:  # [Lp, ...] every chunk's rows in local order
            out = part_out.new_empty((q_pre.shape[0],) + part_out.shape[1:])
            lse = part_lse.new_empty((q_pre.shape[0],) + part_lse.shape[1:])
        out.index_copy_(0, rows, part_out)
        lse.index_copy_(0, rows, part_lse)
    return ops.merge_attn_states(out, lse, *diagonal)


def chunk_attention(ops: AttentionOps, q_part, k_pre, v_pre, cu_q, restored_cu, keys_before,
                    scale: float) -> Partial:
    """Attention of one chunk's queries ``q_part`` over the ``keys_before`` ([P], ``k c``)
    keys before it in the restored prefill K/V (``restored_cu``: each prefill's rows; its
    diagonal is merged in by the caller), reading a prefix of each prefill's restored rows in
    place (``seqused_k``)."""
    return ops.varlen_attention(q_part, k_pre, v_pre, cu_q, restored_cu, scale=scale,
                                causal=False, seqused_k=keys_before)
