"""Single-device attention impl: every state, from one general plan.

Each query row gets (a) attention over the step's own new tokens (causal, bottom-right) and
(b) attention over the request's cached context; the two partials merge by LSE. The CP impl
(:mod:`cp_attention.impl.cp`) overrides only the hooks that move data between ranks.
"""
from __future__ import annotations

import torch

from cp_attention.config import debug_checks_from_env
from cp_attention.impl.checks import check_forward_call, check_forward_values
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.ops import AttentionOps, get_ops

ATTN_TYPES = ("decoder", "encoder_only", "encoder", "encoder_decoder")


class BaseAttentionImpl:
    """Attention of one layer on one rank. Shapes: q [T, Hq, D], k/v [T, Hkv, D] (or flat)."""

    supports_pcp = False
    supports_dcp = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, attn_type: str = "decoder",
                 kv_cache_dtype: str = "auto", ops: AttentionOps | None = None,
                 groups=None, debug: bool | None = None) -> None:
        """groups: a :class:`~cp_attention.parallel.CPGroups` (CP impls) or None; debug: also
        run the O(n) value checks of every call (None: ``CP_ATTENTION_DEBUG``)."""
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if attn_type not in ATTN_TYPES:
            raise ValueError(f"attn_type must be one of {ATTN_TYPES}, got {attn_type!r}")
        if attn_type in ("encoder", "encoder_decoder"):
            raise NotImplementedError(f"attn_type {attn_type!r} (cross-attention) is not supported; "
                                      "use 'decoder' or 'encoder_only'")
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        if head_size < 1:
            raise ValueError(f"head_size must be >= 1, got {head_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"kv_cache_dtype {kv_cache_dtype!r} (quantized KV cache) is "
                                      "not supported; use 'auto'")
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        self.sliding_window = sliding_window
        self.attn_type = attn_type
        self.causal = attn_type == "decoder"
        self.groups = groups
        self.debug = debug_checks_from_env() if debug is None else debug
        self.ops = ops if ops is not None else get_ops(groups.device if groups is not None else "cpu")

    # -- hooks (identity on one device) ------------------------------------------------
    def _step_kv(self, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata):
        """Start producing the K/V of the step rows (all new tokens of the step, restored).

        Returns a handle for :meth:`_wait_step_kv`; on one device the K/V themselves.
        """
        return key, value

    def _wait_step_kv(self, handle) -> tuple[torch.Tensor, torch.Tensor]:
        """The step rows' K/V [step rows, Hkv, D] of a :meth:`_step_kv` handle."""
        return handle

    def _context_queries(self, query: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Queries that attend this rank's cached context: [context rows, heads, D]."""
        return query

    def _combine_context(self, out: torch.Tensor, lse: torch.Tensor, meta: AttentionMetadata
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Partials over this rank's context -> full context attention of the local rows."""
        return out, lse

    def _prefill_self_attention(self, q, k, v, step_kv, meta):
        """Local prefill rows over the step's prefill tokens (``step_kv``: a _step_kv handle)."""
        step_k, step_v = self._wait_step_kv(step_kv)
        start = meta.num_decode_tokens
        q_pre = q[start:]
        k_pre, v_pre = step_k[start:], step_v[start:]
        if not self.causal:
            k_pre, v_pre = k_pre[meta.prefill_real_kv_idx - start], v_pre[meta.prefill_real_kv_idx - start]
            return self.ops.varlen_attention(q_pre, k_pre, v_pre, meta.prefill_cu_seqlens,
                                             meta.prefill_real_cu_seqlens, scale=self.scale,
                                             causal=False)
        cu = meta.prefill_cu_seqlens
        return self.ops.varlen_attention(q_pre, k_pre, v_pre, cu, cu, scale=self.scale,
                                         causal=True, window=self.sliding_window)

    # -- forward -------------------------------------------------------------------------
    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor | None, attn_metadata: AttentionMetadata,
                output: torch.Tensor | None = None, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """Compute attention for the metadata's local rows into ``output`` and return it."""
        meta = attn_metadata
        check_forward_call(self, layer, query, key, value, kv_cache, meta, output, output_scale,
                           output_block_scale)
        if self.debug:
            check_forward_values(query, key, value, kv_cache, meta)
        rows, dim = meta.num_actual_tokens, self.head_size
        q = _head_rows(query, rows, self.num_heads, dim)
        k = _head_rows(key, rows, self.num_kv_heads, dim)
        v = _head_rows(value, rows, self.num_kv_heads, dim)
        pad_rows = None if meta.pad_rows is None else meta.pad_rows.to(q.device)[:, None, None]
        if pad_rows is not None:  # padding may hold anything: keep it out of the sums
            k = k.masked_fill(pad_rows, 0)
            v = v.masked_fill(pad_rows, 0)

        if meta.single_pass is not None:  # decode-only, queries not gathered (checked: decoder)
            out = self._single_pass(q, k, v, kv_cache, meta)
        else:
            out = self._attention(q, k, v, kv_cache, meta)
        if pad_rows is not None:
            out = out.masked_fill(pad_rows, 0)
        if output.shape == out.shape:  # no graph padding: one copy (and cast)
            return output.copy_(out)
        out_view = output.view(output.shape[0], -1)
        out_view[:rows] = out.reshape(rows, -1)
        if rows < output.shape[0]:
            out_view[rows:] = 0
        return output

    def _single_pass(self, q, k, v, kv_cache, meta) -> torch.Tensor:
        """Write the step's K/V, then one paged call over the cache (CP: this rank's shard,
        partials combined as context ones): out [rows, Hq, D]."""
        key_cache, value_cache = kv_cache.unbind(0)
        plan = meta.single_pass
        out, lse = self.ops.cache_and_paged_attention(
            self._context_queries(q, meta), k, v, key_cache, value_cache,
            meta.step_slot_mapping, meta.ctx_block_table, meta.ctx_cu_seqlens, plan.seq_lens,
            scale=self.scale, kv_start=plan.kv_start, kv_end=plan.kv_end)
        return self._combine_context(out, lse, meta)[0]

    def _attention(self, q, k, v, kv_cache, meta) -> torch.Tensor:
        """Self part over the step's new tokens, cache write, context part, LSE merge:
        out [rows, Hq, D]."""
        step_kv = self._step_kv(k, v, meta)  # CP: an all-gather, overlapped with attention
        out, lse = self._self_attention(q, k, v, step_kv, meta)
        if self.attn_type != "decoder":  # encoder-only: no cache, no context (checked)
            return out
        key_cache, value_cache = kv_cache.unbind(0)
        step_k, step_v = self._wait_step_kv(step_kv)
        self.ops.reshape_and_cache(step_k, step_v, key_cache, value_cache, meta.step_slot_mapping)
        if meta.has_context:
            ctx_out, ctx_lse = self.ops.paged_attention(
                self._context_queries(q, meta), key_cache, value_cache, meta.ctx_block_table,
                meta.ctx_cu_seqlens, meta.ctx_seq_lens, scale=self.scale,
                kv_start=meta.ctx_kv_start, kv_end=meta.ctx_kv_end)
            ctx_out, ctx_lse = self._combine_context(ctx_out, ctx_lse, meta)
            out, _ = self.ops.merge_attn_states(out, lse, ctx_out.to(out.dtype),
                                                ctx_lse.to(lse.dtype))
        return out

    def _self_attention(self, q, k, v, step_kv, meta):
        """Attention of every local row over the step's own new tokens."""
        num_dec = meta.num_decode_tokens
        rows = q.shape[0]
        if num_dec == rows:
            return self._decode_self_attention(q, k, v, meta)
        if num_dec == 0:
            return self._prefill_self_attention(q, k, v, step_kv, meta)
        dec_out, dec_lse = self._decode_self_attention(q[:num_dec], k[:num_dec], v[:num_dec], meta)
        pre_out, pre_lse = self._prefill_self_attention(q, k, v, step_kv, meta)
        return torch.cat([dec_out, pre_out]), torch.cat([dec_lse, pre_lse])

    def _decode_self_attention(self, q, k, v, meta):
        cu = meta.decode_cu_seqlens
        return self.ops.varlen_attention(q, k, v, cu, cu, scale=self.scale, causal=True,
                                         window=self.sliding_window)


def _head_rows(x: torch.Tensor, rows: int, heads: int, dim: int) -> torch.Tensor:
    """The first ``rows`` rows of ``x`` ([T, heads, dim] or [T, heads * dim]) as
    [rows, heads, dim]; ``x`` itself when it is that already."""
    if x.shape == (rows, heads, dim):
        return x
    return x[:rows].reshape(rows, heads, dim)
