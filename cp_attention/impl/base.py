"""The attention impl of one layer: the forward as explicit steps, for any group sizes. Each
row attends the step's own new tokens (self part, :mod:`~cp_attention.impl.self_part`) and its
request's cached context (context part, :mod:`~cp_attention.impl.context`), merged by LSE; a
layer enters each of the two modules once, and every collective is a no-op for a group of one."""
from __future__ import annotations

import torch

from cp_attention import envs
from cp_attention.comm import Communicator
from cp_attention.impl.checks import check_forward_call, check_forward_values
from cp_attention.impl.context import context_attention, single_pass_attention
from cp_attention.impl.self_part import self_attention
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.ops import AttentionOps, get_ops

ATTN_TYPES = ("decoder", "encoder_only", "encoder", "encoder_decoder")


class BaseAttentionImpl:
    """Attention of one layer on one rank. Shapes: q [T, Hq, D], k/v [T, Hkv, D] (or flat)."""

    dcp_comm_backend = "ag_rs"  # how DCP partials are combined (CPAttentionImpl's argument)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, attn_type: str = "decoder",
                 kv_cache_dtype: str = "auto", ops: AttentionOps | None = None,
                 groups=None, debug: bool | None = None, comm: Communicator | None = None
                 ) -> None:
        """groups: a :class:`~cp_attention.parallel.CPGroups` (CP impls) or None; debug: also
        run the O(n) value checks of every call (None: ``CP_ATTENTION_DEBUG``); comm: runs the
        collectives (None: a plain :class:`Communicator`, the groups' own backends)."""
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
        self.debug = envs.CP_ATTENTION_DEBUG if debug is None else debug
        self.ops = ops if ops is not None else get_ops(groups.device if groups is not None else "cpu")
        self.comm = comm if comm is not None else Communicator()
        self.pcp_group = groups.pcp_group if groups is not None else None  # None: one rank,
        self.dcp_group = groups.dcp_group if groups is not None else None  # steps are no-ops

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
        rows, dim = meta.num_local_rows, self.head_size
        q = _head_rows(query, rows, self.num_heads, dim)
        k = _head_rows(key, rows, self.num_kv_heads, dim)
        v = _head_rows(value, rows, self.num_kv_heads, dim)
        pad_rows = None if meta.pad_rows is None else meta.pad_rows.to(q.device)[:, None, None]
        if pad_rows is not None:  # padding may hold anything: keep it out of the sums
            k = k.masked_fill(pad_rows, 0)
            v = v.masked_fill(pad_rows, 0)

        if meta.single_pass:  # decode-only, queries not gathered (checked: decoder)
            out = single_pass_attention(self.ops, self.comm, q, k, v, *kv_cache.unbind(0), meta,
                                        self.pcp_group, self.dcp_group, self.dcp_comm_backend,
                                        self.scale)
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

    def _attention(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The general plan: out [rows, Hq, D] of the local rows q [rows, Hq, D]."""
        # 1, 2. gather the step's K/V over PCP; self part: local rows over the step's new tokens
        (out, lse), (step_k, step_v, slots) = self_attention(
            self.ops, self.comm, q, k, v, meta, self.pcp_group, self.scale, self.causal,
            self.sliding_window)
        if self.attn_type != "decoder":  # encoder-only: no cache, no context (checked)
            return out
        # 3. write cache: the step rows' K/V on this rank's shard
        key_cache, value_cache = kv_cache.unbind(0)
        self.ops.reshape_and_cache(step_k, step_v, key_cache, value_cache, slots)
        if not meta.has_context:
            return out
        # 4, 5. context part: the local rows over every KV shard of their cached context
        ctx_out, ctx_lse = context_attention(self.ops, self.comm, q, key_cache, value_cache, meta,
                                             self.pcp_group, self.dcp_group,
                                             self.dcp_comm_backend, self.scale)
        return self.ops.merge_attn_states(out, lse, ctx_out.to(out.dtype),
                                          ctx_lse.to(lse.dtype))[0]


def _head_rows(x: torch.Tensor, rows: int, heads: int, dim: int) -> torch.Tensor:
    """The first ``rows`` rows of ``x`` ([T, heads, dim] or [T, heads * dim]) as
    [rows, heads, dim]; ``x`` itself when it is that already."""
    if x.shape == (rows, heads, dim):
        return x
    return x[:rows].reshape(rows, heads, dim)
