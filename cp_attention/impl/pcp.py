"""PCP prefill in the forward (no-ops without PCP): the all-gather of the step's prefill K/V
(:class:`StepKV`) and the self part of a rank's head and tail chunks (HeadTail), each chunk's
causal diagonal on local rows while the gather is in flight (docs/pcp.md, section 2)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from cp_attention.comm import Communicator
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.metadata.pcp import PCPSplit
from cp_attention.ops import AttentionOps


class StepKV:
    """The step rows' K/V, ``[step rows, Hkv, D]`` each: the layer's own rows, or (PCP) the
    decode rows and every rank's prefill rows, restored, once the all-gather has arrived."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, pending: tuple | None = None
                 ) -> None:
        self._kv, self._pending = (key, value), pending  # pending: (gathered, work, restore)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values): decode rows, then the restored prefill rows."""
        if self._pending is not None:
            gathered, work, restore_idx = self._pending
            if work is not None:
                work.wait()
            kv, (decode_k, decode_v) = gathered[restore_idx], self._kv
            self._kv = ((torch.cat([decode_k, kv[:, 0]]), torch.cat([decode_v, kv[:, 1]]))
                        if decode_k.shape[0] else (kv[:, 0], kv[:, 1]))  # prefill-only: no copy
            self._pending = None
        return self._kv


def gather_step_kv(comm: Communicator, key: torch.Tensor, value: torch.Tensor,
                   meta: AttentionMetadata, pcp_group: dist.ProcessGroup | None) -> StepKV:
    """Start the all-gather of the local prefill K/V rows (``[Lp, Hkv, D]`` each) over PCP;
    without PCP prefill rows the step rows are the layer's own."""
    split, nd = meta.pcp, meta.num_decode_tokens
    if split is None or split.num_local_rows == 0:
        return StepKV(key, value)
    local = torch.stack([key[nd:], value[nd:]], dim=1)  # [Lp, 2, Hkv, D]
    gathered, work = comm.all_gather_async(local, pcp_group)
    return StepKV(key[:nd], value[:nd],
                  (gathered, work, split.pcp_allgather_restore_idx.to(key.device)))


def pcp_prefill_attention(ops: AttentionOps, q_pre: torch.Tensor, k_loc: torch.Tensor,
                          v_loc: torch.Tensor, step_kv: StepKV, split: PCPSplit, nd: int,
                          scale: float, window: int | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local prefill rows q_pre [Lp, Hq, D] (k_loc, v_loc [Lp, Hkv, D]) over each prefill's
    tokens up to their own; ``step_kv``: the step rows (``nd`` decode rows first).
    Returns out [Lp, Hq, D] and lse [Lp, Hq] in local row order."""
    cu_q = split.chunk_cu_seqlens
    rows = split.chunk_q_idx.to(q_pre.device)  # [m, sum c]
    # the diagonals (causal, local rows only) while the all-gather is in flight
    diagonals = [None if window is not None else ops.varlen_attention(
        q_pre[r], k_loc[r], v_loc[r], cu_q, cu_q, scale=scale, causal=True) for r in rows]
    step_k, step_v = step_kv.wait()
    k_pre, v_pre = step_k[nd:], step_v[nd:]
    restored_cu = cu_q * (2 * split.pcp_size)  # each prefill's 2 pcp c restored rows
    outs, lses = zip(*(chunk_attention(ops, q_pre[r], k_pre, v_pre, cu_q, restored_cu, before,
                                       diagonal, scale, window)
                       for r, before, diagonal in zip(rows, split.chunk_keys_before, diagonals)))
    local_order = split.q_full_idx.to(q_pre.device)  # [chunk rows...] -> local rows
    return torch.cat(outs)[local_order], torch.cat(lses)[local_order]


def chunk_attention(ops: AttentionOps, q_part, k_pre, v_pre, cu_q, restored_cu, keys_before,
                    diagonal, scale: float, window: int | None):
    """Attention of one chunk's queries ``q_part`` over the restored prefill K/V
    (``restored_cu``: each prefill's rows): the ``keys_before`` ([P], ``k c``) keys before it
    merged with its ``diagonal``, or with a sliding window one bottom-right causal call over
    both (``(k + 1) c`` keys). Both read a prefix of each prefill's restored rows in place
    (``seqused_k``)."""
    if window is not None:
        return ops.varlen_attention(q_part, k_pre, v_pre, cu_q, restored_cu, scale=scale,
                                    causal=True, window=window,
                                    seqused_k=keys_before + cu_q.diff())
    before = ops.varlen_attention(q_part, k_pre, v_pre, cu_q, restored_cu, scale=scale,
                                  causal=False, seqused_k=keys_before)
    return ops.merge_attn_states(*before, *diagonal)
