"""Checks of one attention layer call, made once at ``forward`` (the impl's only boundary).

* :func:`check_forward_call`: O(1) per call (shapes, dtypes, devices, options, the metadata's
  rank and window against the layer); always on.
* :func:`check_forward_values`: O(tokens + requests x blocks): slot-mapping ranges, cumulative
  lengths, context block tables, finite inputs. Runs only in debug mode (``debug=True`` on the
  impl, or ``CP_ATTENTION_DEBUG=1``; the test suite turns it on).
Both raise :class:`~cp_attention.errors.AttentionLayerError` (``NotImplementedError`` for
unsupported options). The ops themselves check only O(1) argument shapes.
"""
from __future__ import annotations

import math

import torch

from cp_attention.errors import AttentionLayerError, OpsInputError
from cp_attention.mathutils import ceil_div
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.ops.checks import validate_cu_seqlens, validate_slot_mapping

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_forward_call(impl, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor | None, meta: AttentionMetadata,
                       output: torch.Tensor | None, output_scale=None,
                       output_block_scale=None) -> None:
    """O(1) checks of a ``BaseAttentionImpl.forward`` call (``impl``: the calling impl; its
    num_heads, num_kv_heads, head_size, sliding_window, attn_type and groups are read).

    query/output: [T, Hq, D] or [T, Hq * D]; key/value: [T, Hkv, D] or flat, T >=
    ``meta.num_input_tokens``; kv_cache: (2, num_blocks, block_size, Hkv, D).
    """
    if output is None:
        raise AttentionLayerError("output buffer is required (forward writes into it)")
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("fused output quantization is not supported")
    for name in ("_k_scale_float", "_v_scale_float"):
        scale = getattr(layer, name, 1.0) if layer is not None else 1.0
        if scale != 1.0:
            raise NotImplementedError(f"layer.{name} = {scale}: scaled (quantized) K/V is "
                                      "not supported; scales must be 1.0")
    if meta.sliding_window != impl.sliding_window:
        raise AttentionLayerError(f"metadata was built for sliding_window={meta.sliding_window}"
                                  f" but this layer uses {impl.sliding_window}")
    _check_tensors(impl, query, key, value, output, meta)
    groups = impl.groups
    if groups is not None:
        if meta.pcp_rank != groups.ranks.pcp_rank:
            raise AttentionLayerError(f"metadata was built for pcp_rank={meta.pcp_rank}, "
                                      f"this rank is pcp_rank={groups.ranks.pcp_rank}")
        if meta.pcp_size != groups.config.pcp_size:
            raise AttentionLayerError(f"metadata was built for pcp_size={meta.pcp_size}, "
                                      f"the impl uses pcp_size={groups.config.pcp_size}")
    if impl.attn_type == "encoder_only":
        if meta.has_context or meta.num_decodes:
            raise AttentionLayerError("encoder_only attention takes prefills without context")
        return
    if kv_cache is None:
        raise AttentionLayerError("decoder attention needs a kv_cache")
    _check_kv_cache(impl, kv_cache, key)


def _check_tensors(impl, query, key, value, output, meta: AttentionMetadata) -> None:
    rows = query.shape[0]
    if rows < meta.num_input_tokens:
        raise AttentionLayerError(f"query has {rows} rows but the metadata was built for "
                                  f"num_input_tokens={meta.num_input_tokens}")
    q_shape = (rows, impl.num_heads, impl.head_size)
    kv_shape = (rows, impl.num_kv_heads, impl.head_size)
    if not (query.shape == output.shape == q_shape and key.shape == value.shape == kv_shape):
        _check_row_shapes(impl, query, key, value, output)  # flat [T, H * D] rows, or an error
    device = query.device
    if key.device != device or value.device != device or output.device != device:
        raise AttentionLayerError(f"query, key, value and output must share a device, got "
                                  f"{device}, {key.device}, {value.device}, {output.device}")
    if query.dtype not in FLOAT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise AttentionLayerError(f"query/key/value dtypes must match floating dtypes, got "
                                  f"{query.dtype}/{key.dtype}/{value.dtype}")
    if output.dtype not in FLOAT_DTYPES:
        raise AttentionLayerError(f"output dtype {output.dtype} is not one of {FLOAT_DTYPES}")
    if output.numel() and output.data_ptr() in (query.data_ptr(), key.data_ptr(),
                                                value.data_ptr()):
        raise AttentionLayerError("output must not alias query, key or value")


def _check_row_shapes(impl, query, key, value, output) -> None:
    """Each tensor is [T, heads, D] or [T, heads * D] with the query's T."""
    rows = query.shape[0]
    for name, tensor, heads in (("query", query, impl.num_heads), ("key", key, impl.num_kv_heads),
                                ("value", value, impl.num_kv_heads),
                                ("output", output, impl.num_heads)):
        if tensor.dim() not in (2, 3):
            raise AttentionLayerError(f"{name} must be 2-D or 3-D, got shape {tuple(tensor.shape)}")
        if tensor.shape[0] != rows:
            raise AttentionLayerError(f"{name} has {tensor.shape[0]} rows but query has {rows}")
        row_size = math.prod(tensor.shape[1:])
        if row_size != heads * impl.head_size:
            raise AttentionLayerError(f"{name} rows hold {row_size} values, expected "
                                      f"{heads} heads x {impl.head_size}")


def _check_kv_cache(impl, kv_cache: torch.Tensor, key: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or \
            tuple(kv_cache.shape[3:]) != (impl.num_kv_heads, impl.head_size):
        raise AttentionLayerError(f"kv_cache shape {tuple(kv_cache.shape)} must be "
                                  f"(2, num_blocks, block_size, {impl.num_kv_heads}, "
                                  f"{impl.head_size})")
    if kv_cache.dtype != key.dtype or kv_cache.device != key.device:
        raise AttentionLayerError(f"kv_cache is {kv_cache.dtype} on {kv_cache.device}, "
                                  f"key is {key.dtype} on {key.device}")
    if impl.groups is not None and kv_cache.shape[2] != impl.groups.config.block_size:
        raise AttentionLayerError(f"kv_cache block_size {kv_cache.shape[2]} != the config's "
                                  f"block_size {impl.groups.config.block_size}")


def check_forward_values(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> None:
    """O(n) checks of a call (debug mode), after :func:`check_forward_call`.

    Every input row finite; the metadata's cumulative lengths start at 0 and never decrease;
    each slot of ``step_slot_mapping`` is -1 or inside the cache and written once; each used
    entry of ``ctx_block_table`` names a block of the cache.
    """
    rows = meta.num_local_rows
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not bool(torch.isfinite(tensor[:rows]).all()):
            raise AttentionLayerError(f"{name} holds NaN or inf in its first {rows} rows")
    if meta.local_token_idx.shape[0] != meta.num_input_tokens:
        raise AttentionLayerError(f"metadata local_token_idx has {meta.local_token_idx.shape[0]}"
                                  f" rows, num_input_tokens={meta.num_input_tokens}")
    _check_cumulative(meta)
    if kv_cache is None:
        return
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    validate_slot_mapping(meta.step_slot_mapping, num_blocks * block_size,
                          error=AttentionLayerError)
    if meta.has_context and meta.ctx_block_table.numel():
        _check_ctx_blocks(meta, num_blocks, block_size)


def _check_cumulative(meta: AttentionMetadata) -> None:
    """decode / prefill / context cu_seqlens: from 0, non-decreasing, ending at their rows."""
    num_dec, num_pre = meta.num_decode_tokens, meta.num_local_rows - meta.num_decode_tokens
    ctx_copies = meta.pcp_size if meta.ctx_over_pcp else 1
    for name, rows in (("decode_cu_seqlens", num_dec), ("prefill_cu_seqlens", num_pre),
                       ("ctx_cu_seqlens", num_dec + ctx_copies * num_pre)):
        try:
            validate_cu_seqlens(getattr(meta, name), rows, name)
        except OpsInputError as exc:
            raise AttentionLayerError(f"metadata {exc}") from None


def _check_ctx_blocks(meta: AttentionMetadata, num_blocks: int, block_size: int) -> None:
    lens = meta.ctx_seq_lens.long()
    table = meta.ctx_block_table.long()
    needed = ceil_div(lens, block_size)
    if int(needed.max()) > table.shape[1]:
        raise AttentionLayerError(f"ctx_block_table has {table.shape[1]} blocks but a request "
                                  f"holds {int(lens.max())} tokens of {block_size}-token blocks")
    used = table[torch.arange(table.shape[1])[None, :] < needed[:, None]]
    bad = used[(used < 0) | (used >= num_blocks)]
    if bad.numel():
        raise AttentionLayerError(f"ctx_block_table holds block {int(bad[0])} outside the "
                                  f"kv_cache's [0, {num_blocks})")
