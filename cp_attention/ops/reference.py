"""Portable pure-torch implementation of :class:`~cp_attention.ops.interface.AttentionOps`.

The hot paths call PyTorch's fused CPU attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the LSE) on whole
requests; bottom-right causal attention with more keys than queries is split into an unmasked
prefix and a causal square, merged by LSE. Only sliding windows and explicit key ranges use an
additive mask, built per block of queries over the keys that block can see, so memory stays
O(block x visible keys).
"""
from __future__ import annotations

import torch

from cp_attention.errors import OpsInputError
from cp_attention.mathutils import ceil_div
from cp_attention.ops.checks import check_cache_write_args, check_paged_args, check_varlen_args
from cp_attention.ops.interface import AttentionOps, Mask, accumulation_dtype, empty_result
from cp_attention.ops.merge import merge_attn_states

_QUERY_BLOCK = 512  # query rows per masked block


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [nq, Hq, D], k/v: [nk, Hkv, D] (nk > 0) -> out [nq, Hq, D], lse [nq, Hq]."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), 0.0, causal, attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1), lse[0].transpose(0, 1)
    return _explicit(q, k, v, scale, causal, mask)


def _explicit(q, k, v, scale, causal, mask):
    """Plain matmul-softmax attention (devices without the CPU fused kernel)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        scores = scores.masked_fill(
            torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1),
            float("-inf"))
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse.transpose(0, 1)


def _ranged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query i sees keys [lo[i], hi[i]). q/k/v already in the accumulation dtype."""
    out, lse = empty_result(q, q.dtype)
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        stop = min(start + _QUERY_BLOCK, q.shape[0])
        lo_b, hi_b = lo[start:stop], hi[start:stop]
        k_lo, k_hi = int(lo_b.min()), int(hi_b.max())
        if k_hi <= k_lo:
            continue
        keys = torch.arange(k_lo, k_hi, device=q.device)
        visible = (keys >= lo_b[:, None]) & (keys < hi_b[:, None])
        k_b, v_b = k[k_lo:k_hi], v[k_lo:k_hi]
        if bool(visible.all()):
            o_b, l_b = _fused(q[start:stop], k_b, v_b, scale, False)
        else:
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(~visible, float("-inf"))
            o_b, l_b = _fused(q[start:stop], k_b, v_b, scale, False, mask)
            empty_rows = ~visible.any(dim=1)
            o_b = o_b.masked_fill(empty_rows[:, None, None], 0.0)
            l_b = l_b.masked_fill(empty_rows[:, None], float("-inf"))
        out[start:stop], lse[start:stop] = o_b, l_b.to(lse.dtype)
    return out, lse


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                 mask: Mask) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q [nq, Hq, D], k/v [nk, Hkv, D] -> (out, lse) in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    nq, nk = q.shape[0], k.shape[0]
    if nq == 0 or nk == 0:
        return empty_result(q, acc)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    if mask.window is not None:
        rows = torch.arange(nq, device=q.device) + (nk - nq)  # keys [row - left, row]
        return _ranged(q, k, v, scale, (rows - mask.bounds[0]).clamp(min=0),
                       (rows + 1).clamp(min=0))
    if not mask.causal:
        return _fused(q, k, v, scale, False)
    if nq > nk:  # the first nq - nk queries see nothing
        out, lse = empty_result(q, acc)
        out[nq - nk:], lse[nq - nk:] = attend_dense(q[nq - nk:], k, v, scale=scale, mask=mask)
        return out, lse
    diag_out, diag_lse = _fused(q, k[nk - nq:], v[nk - nq:], scale, True)
    if nk == nq:
        return diag_out, diag_lse
    prefix_out, prefix_lse = _fused(q, k[:nk - nq], v[:nk - nq], scale, False)
    return merge_attn_states(prefix_out, prefix_lse, diag_out, diag_lse)


class ReferenceOps(AttentionOps):
    """Pure-torch ops: the tested default on every device.

    Every call makes the O(1) argument checks of :mod:`cp_attention.ops.checks`; the O(n)
    value checks (slot ranges, offsets, block ids) are the caller's, in debug mode.
    """

    name = "reference"

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal,
                         window=None, seqused_k=None):
        check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
        mask = Mask(causal, window)
        acc = accumulation_dtype(q.dtype)
        out, lse = empty_result(q, acc)
        bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        used = None if seqused_k is None else seqused_k.tolist()
        for r in range(len(bounds_q) - 1):
            qs, qe, ks, ke = bounds_q[r], bounds_q[r + 1], bounds_k[r], bounds_k[r + 1]
            if used is not None:  # the first seqused_k[r] keys of the range (a view, no copy)
                if not 0 <= used[r] <= ke - ks:
                    raise OpsInputError(f"seqused_k[{r}] = {used[r]} outside [0, {ke - ks}] "
                                        f"(the request's cu_seqlens_k range)")
                ke = ks + used[r]
            if qe > qs and ke > ks:
                out[qs:qe], lse[qs:qe] = attend_dense(
                    q[qs:qe], k[ks:ke], v[ks:ke], scale=scale, mask=mask)
        return out, lse

    def paged_attention(self, q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                        *, scale, kv_start=None, kv_end=None):
        check_paged_args(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)
        acc = accumulation_dtype(q.dtype)
        out, lse = empty_result(q, acc)
        block_size = key_cache.shape[1]
        bounds_q, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
        for r, seq_len in enumerate(lens):
            qs, qe = bounds_q[r], bounds_q[r + 1]
            if qe == qs or seq_len == 0:
                continue
            blocks = block_table[r, :ceil_div(seq_len, block_size)].long()
            k = key_cache[blocks].flatten(0, 1)[:seq_len].to(acc)
            v = value_cache[blocks].flatten(0, 1)[:seq_len].to(acc)
            q_r = q[qs:qe].to(acc)
            if kv_start is None and kv_end is None:
                out[qs:qe], lse[qs:qe] = _fused(q_r, k, v, scale, False)
                continue
            lo = (kv_start[qs:qe] if kv_start is not None
                  else torch.zeros(qe - qs, dtype=torch.long, device=q.device))
            hi = (kv_end[qs:qe] if kv_end is not None
                  else torch.full((qe - qs,), seq_len, dtype=torch.long, device=q.device))
            out[qs:qe], lse[qs:qe] = _ranged(q_r, k, v, scale, lo.long().clamp(0, seq_len),
                                             hi.long().clamp(0, seq_len))
        return out, lse

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        """Works on strided views too (e.g. a cache laid out as [blocks, heads, slots, D])."""
        check_cache_write_args(key, value, key_cache, value_cache, slot_mapping)
        block_size = key_cache.shape[1]
        slot_mapping = slot_mapping.to(key_cache.device)  # the host's, as the metadata has it
        stored = slot_mapping >= 0
        slots = slot_mapping[stored].long()
        blocks, offsets = slots // block_size, slots % block_size
        key_cache[blocks, offsets] = key[stored].to(key_cache.dtype)
        value_cache[blocks, offsets] = value[stored].to(value_cache.dtype)

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b):
        return merge_attn_states(out_a, lse_a, out_b, lse_b)
