"""The self part of a PCP rank's prefill rows: head and tail chunks (HeadTail).

Each chunk attends the keys before it unmasked and its own rows with a causal mask (the
diagonal), merged by LSE; with a sliding window one bottom-right causal call does both. The
diagonals need only local rows, so they run while the K/V all-gather is in flight; the
unmasked part of chunk k reads the first ``k c`` restored keys of each prefill in place
(``varlen_attention``'s ``seqused_k``), no gathered copy.
"""
from __future__ import annotations

import torch

from cp_attention.impl.exchange import StepKV
from cp_attention.metadata.pcp import ChunkPlan, PCPSplit
from cp_attention.ops import AttentionOps


def pcp_prefill_attention(ops: AttentionOps, q_pre: torch.Tensor, k_loc: torch.Tensor,
                          v_loc: torch.Tensor, step_kv: StepKV, split: PCPSplit, nd: int,
                          scale: float, window: int | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local prefill rows q_pre [Lp, Hq, D] (k_loc, v_loc [Lp, Hkv, D]) over each prefill's
    tokens up to their own; ``step_kv``: the step rows (``nd`` decode rows first).
    Returns out [Lp, Hq, D] and lse [Lp, Hq] in local row order."""
    cu_q = split.chunk_cu_seqlens
    parts = [chunk_diagonal(ops, q_pre, k_loc, v_loc, chunk, cu_q, scale, window)
             for chunk in split.chunks]
    step_k, step_v = step_kv.wait()
    k_pre, v_pre = step_k[nd:], step_v[nd:]
    restored_cu = cu_q * (2 * split.pcp_size)  # each prefill's 2 pcp c restored rows
    outs, lses = zip(*(chunk_attention(ops, q_part, k_pre, v_pre, chunk, cu_q, diagonal,
                                       restored_cu, scale, window)
                       for chunk, (q_part, diagonal) in zip(split.chunks, parts)))
    local_order = split.q_full_idx.to(q_pre.device)  # [chunk rows...] -> local rows
    return torch.cat(outs)[local_order], torch.cat(lses)[local_order]


def chunk_diagonal(ops: AttentionOps, q_pre, k_loc, v_loc, chunk: ChunkPlan, cu_q, scale: float,
                   window: int | None):
    """One chunk's queries ``[sum c, H, D]`` and their causal attention over the chunk's own
    (local) rows, ``(out, lse)`` (None with a sliding window: one call does all)."""
    rows = chunk.q_idx.to(q_pre.device)
    q_part = q_pre[rows]
    if window is not None:
        return q_part, None
    return q_part, ops.varlen_attention(q_part, k_loc[rows], v_loc[rows], cu_q, cu_q,
                                        scale=scale, causal=True)


def chunk_attention(ops: AttentionOps, q_part, k_pre, v_pre, chunk: ChunkPlan, cu_q, diagonal,
                    restored_cu, scale: float, window: int | None):
    """Attention of one chunk's queries ``q_part`` over the restored prefill K/V
    (``restored_cu``: each prefill's rows): the keys before it merged with its ``diagonal``,
    or with a sliding window one bottom-right causal call over both. Both read a prefix of
    each prefill's restored rows in place (``seqused_k``: ``k c`` keys before chunk k,
    ``(k + 1) c`` up to its end)."""
    if window is not None:
        return ops.varlen_attention(q_part, k_pre, v_pre, cu_q, restored_cu, scale=scale,
                                    causal=True, window=window,
                                    seqused_k=chunk.cu_seqlens_k.diff())
    before = ops.varlen_attention(q_part, k_pre, v_pre, cu_q, restored_cu, scale=scale,
                                  causal=False, seqused_k=chunk.nomask_cu_seqlens_k.diff())
    return ops.merge_attn_states(*before, *diagonal)
