"""Every public entry point rejects bad input with a typed error naming the field and value.

``CASES`` is the table of docs/errors.md (entry point, input, error type, message fragment,
where the check runs); one test per row asserts the type and the fragment. ``where``:
"entry point" (always on), "debug" (the O(n) checks of an impl built with ``debug=True``, as
``CP_ATTENTION_DEBUG=1`` does for the whole suite), "check" (a check function of
:mod:`cp_attention.metadata.checks` / :mod:`cp_attention.ops.checks` called directly; the entry
points call the same functions, docs/errors.md "Where the checks are called").
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig, CPRanks
from cp_attention import envs
from cp_attention.errors import AttentionLayerError, KernelFallbackError, OpsInputError, StepError
from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.impl.cp import CPAttentionImpl
from cp_attention.metadata.builder import MetadataBuilder
from cp_attention.metadata.checks import validate_ranks, validate_step
from cp_attention.metadata.common import StepSpec
from cp_attention.metadata.pcp import HeadTail
from cp_attention.ops import CudaOps, NpuOps, ReferenceOps, get_ops
from cp_attention.ops.checks import (validate_cu_seqlens, validate_kv_cache_shape_args,
                                     validate_merge_inputs, validate_paged_inputs,
                                     validate_slot_mapping, validate_varlen_inputs)
from cp_attention.ops.interface import Mask
from cp_attention.parallel import CPGroups, backend_for_device

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
H, D, BS = 2, 8, 16


@dataclass(frozen=True)
class Case:
    entry: str
    input: str
    error: type[BaseException]
    fragment: str  # a regular expression searched in the message
    call: Callable[[], object]
    where: str = "entry point"  # "entry point", "debug" (O(n), debug mode) or "check"


# -- helpers ----------------------------------------------------------------------------------
def step(computed=(0,), scheduled=(4,), table=None) -> StepSpec:
    table = torch.arange(len(computed)).view(-1, 1).int() if table is None else table
    return StepSpec(computed, scheduled, table)


def single_meta(computed=(0,), scheduled=(4,), table=None, window=None, **kwargs):
    return MetadataBuilder(CPConfig(), sliding_window=window, **kwargs).build(
        step(computed, scheduled, table))


def impl(debug: bool = False, **kwargs) -> BaseAttentionImpl:
    return BaseAttentionImpl(num_heads=H, head_size=D, scale=D ** -0.5, debug=debug, **kwargs)


def qkv(rows=4, dtype=torch.float32):
    return tuple(torch.randn(rows, H, D, dtype=dtype) for _ in range(3))


def strict(call: Callable[[], object]) -> object:
    """``call()`` with ``CP_ATTENTION_STRICT_OPS=1``: a kernel op's fallback is an error."""
    with envs.overridden(CP_ATTENTION_STRICT_OPS="1"):
        return call()


def cache(num_blocks=4, block_size=BS, dtype=torch.float32):
    return torch.zeros(2, num_blocks, block_size, H, D, dtype=dtype)


def forward(query=None, key=None, value=None, kv_cache="default", meta=None, layer=None,
            output="default", the_impl=None, **kwargs):
    q, k, v = qkv()
    query = q if query is None else query
    key = k if key is None else key
    value = v if value is None else value
    kv_cache = cache() if isinstance(kv_cache, str) else kv_cache
    meta = single_meta() if meta is None else meta
    output = torch.empty_like(query) if isinstance(output, str) else output
    return (the_impl or impl()).forward(layer, query, key, value, kv_cache, meta, output=output,
                                        **kwargs)


def debug_forward(**kwargs):
    """``forward`` on an impl that runs the O(n) value checks."""
    return forward(the_impl=impl(debug=True), **kwargs)


def tampered_meta(**fields):
    """Single-device metadata of a 4-token prompt with some fields replaced."""
    meta = single_meta()
    for name, value in fields.items():
        setattr(meta, name, value)
    return meta


class Layer:
    _k_scale_float = 0.5
    _v_scale_float = 1.0


def fake_groups(config: CPConfig, rank: int = 0) -> CPGroups:
    """Groups without processes (enough for constructors and local checks)."""
    return CPGroups(config, CPRanks.of(config, rank), torch.device("cpu"))


def pcp_meta(pcp_rank: int):
    cfg = CPConfig(pcp_size=2)
    return MetadataBuilder(cfg, CPRanks(pcp_rank, 0, 0)).build(step((0,), (8,)))


def cp_impl(rank: int) -> CPAttentionImpl:
    return CPAttentionImpl(num_heads=H, head_size=D, scale=1.0, debug=False,
                           groups=fake_groups(CPConfig(pcp_size=2), rank))


def pcp_forward(impl_rank: int, meta_rank: int, **kwargs):
    """``forward`` of 8 rows on a PCP impl (checks fail before any collective)."""
    q, k, v = qkv(8)
    return forward(query=q, key=k, value=v, the_impl=cp_impl(impl_rank), meta=pcp_meta(meta_rank),
                   **kwargs)


def create_groups_world_mismatch():
    """CPGroups.create on a world of 1 with a config of world 2 (in-process gloo group)."""
    already = dist.is_initialized()
    if not already:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        CPGroups.create(CPConfig(pcp_size=2), "cpu")
    finally:
        if not already:
            dist.destroy_process_group()


TWO_REQ_TABLE = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
F = torch.float32

CASES: list[Case] = [
    # -- CPConfig --------------------------------------------------------------------------
    Case("CPConfig", "pcp_size=0", ValueError, r"pcp_size must be an integer >= 1, got 0",
         lambda: CPConfig(pcp_size=0)),
    Case("CPConfig", "dcp_size=True", ValueError, r"dcp_size must be an integer >= 1, got True",
         lambda: CPConfig(dcp_size=True)),
    Case("CPConfig", "block_size=16.0", ValueError, r"block_size must be an integer >= 1, got 16\.0",
         lambda: CPConfig(block_size=16.0)),
    Case("CPConfig", "decode_threshold=0", ValueError, r"decode_threshold must be an integer",
         lambda: CPConfig(decode_threshold=0)),
    Case("CPConfig", "tp_size=2, dcp_size=4", ValueError,
         r"tp_size \(2\) must be divisible by dcp_size \(4\)", lambda: CPConfig(tp_size=2, dcp_size=4)),
    Case("CPConfig", "block_size=16, cp_kv_interleave_size=3", ValueError,
         r"block_size \(16\) must be a multiple of cp_kv_interleave_size \(3\)",
         lambda: CPConfig(cp_kv_interleave_size=3)),
    Case("CPConfig", "kv_shard='tp'", ValueError, r"kv_shard must be one of .*'tp'",
         lambda: CPConfig(kv_shard="tp")),
    # -- validate_heads --------------------------------------------------------------------
    Case("CPConfig.validate_heads", "num_heads=0", ValueError, r"num_heads \(0\) .* must be >= 1",
         lambda: CPConfig().validate_heads(0, 1)),
    Case("CPConfig.validate_heads", "num_heads=6, num_kv_heads=4", ValueError,
         r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)",
         lambda: CPConfig().validate_heads(6, 4)),
    Case("CPConfig.validate_heads", "tp_size=4, num_heads=6", ValueError,
         r"num_heads \(6\) must be divisible by tp_size \(4\)",
         lambda: CPConfig(tp_size=4).validate_heads(6, 2)),
    Case("CPConfig.validate_heads", "tp_size=4, num_kv_heads=6", ValueError,
         r"num_kv_heads \(6\) must be divisible by tp_size \(4\)",
         lambda: CPConfig(tp_size=4).validate_heads(12, 6)),
    Case("CPConfig.validate_heads", "tp_size=4, num_kv_heads=3", ValueError,
         r"tp_size \(4\) must be divisible by num_kv_heads \(3\)",
         lambda: CPConfig(tp_size=4).validate_heads(12, 3)),
    Case("CPConfig.validate_heads", "tp_size=dcp_size=2, num_kv_heads=2", ValueError,
         r"dcp_size \(2\) needs each KV head replicated",
         lambda: CPConfig(tp_size=2, dcp_size=2).validate_heads(4, 2)),
    # -- ranks and groups ------------------------------------------------------------------
    Case("CPRanks.of", "rank=-1", ValueError, r"rank \(-1\) must be in \[0, world_size=2\)",
         lambda: CPRanks.of(CPConfig(pcp_size=2), -1)),
    Case("CPRanks.of", "rank=world_size", ValueError, r"rank \(2\) must be in \[0, world_size=2\)",
         lambda: CPRanks.of(CPConfig(pcp_size=2), 2)),
    Case("CPRanks.of", "rank=1.5", ValueError, r"rank must be an integer, got 1\.5",
         lambda: CPRanks.of(CPConfig(pcp_size=2), 1.5)),
    Case("CPGroups.single", "world_size=2", ValueError, r"single\(\) needs world_size 1, got 2",
         lambda: CPGroups.single(CPConfig(pcp_size=2))),
    Case("CPGroups.create", "world 1, config world 2", ValueError,
         r"world size 1 != pcp_size \* tp_size = 2", create_groups_world_mismatch),
    Case("backend_for_device", "device 'meta'", ValueError,
         r"no collective backend known for device type 'meta'", lambda: backend_for_device("meta")),
    # -- StepSpec --------------------------------------------------------------------------
    Case("StepSpec", "2 computed, 1 scheduled", ValueError,
         r"num_computed_tokens has 2 requests but num_scheduled_tokens has 1",
         lambda: StepSpec((0, 0), (1,), torch.zeros(2, 1, dtype=torch.int32))),
    Case("StepSpec", "no request", ValueError, r"at least one request",
         lambda: StepSpec((), (), torch.zeros(0, 1, dtype=torch.int32))),
    Case("StepSpec", "num_computed_tokens=(-1,)", ValueError, r"num_computed_tokens\[0\] = -1",
         lambda: step((-1,), (1,))),
    Case("StepSpec", "num_scheduled_tokens=(0,)", ValueError, r"num_scheduled_tokens\[0\] = 0",
         lambda: step((0,), (0,))),
    Case("StepSpec", "num_computed_tokens=(0, 1.5)", ValueError,
         r"num_computed_tokens\[1\] = 1.5 is not an int64 integer", lambda: step((0, 1.5), (1, 1))),
    Case("StepSpec", "num_scheduled_tokens=(True,)", ValueError,
         r"num_scheduled_tokens\[0\] = True is not an int64 integer", lambda: step((0,), (True,))),
    Case("StepSpec", "num_computed_tokens 2-D", ValueError,
         r"num_computed_tokens must be a 1-D sequence of integers",
         lambda: step(torch.zeros(1, 1, dtype=torch.int64), (1,))),
    Case("StepSpec", "float block_table", ValueError, r"block_table must be a 2-D integer tensor",
         lambda: step(table=torch.zeros(1, 1))),
    Case("StepSpec", "1-D block_table", ValueError, r"block_table must be a 2-D integer tensor",
         lambda: step(table=torch.zeros(1, dtype=torch.int32))),
    Case("StepSpec", "block_table rows != requests", ValueError,
         r"block_table has 2 rows for 1 requests",
         lambda: step(table=torch.zeros(2, 1, dtype=torch.int32))),
    # -- builders --------------------------------------------------------------------------
    Case("MetadataBuilder", "sliding_window=0", ValueError, r"sliding_window must be >= 1",
         lambda: MetadataBuilder(sliding_window=0)),
    Case("MetadataBuilder", "pcp_rank=2 of 2", ValueError, r"pcp_rank \(2\) must be an integer in \[0, 2\)",
         lambda: MetadataBuilder(CPConfig(pcp_size=2), CPRanks(2, 0, 0))),
    Case("MetadataBuilder.build", "block table too short", ValueError,
         r"block_table has 1 blocks per request but request 0 needs 2 for 17 tokens",
         lambda: single_meta((0,), (17,))),
    Case("MetadataBuilder.build", "negative block id", ValueError, r"negative block id",
         lambda: single_meta(table=torch.tensor([[-1]], dtype=torch.int32))),
    Case("MetadataBuilder.build", "block id >= num_blocks", ValueError,
         r"block_table names block 4 but the cache has num_blocks=4",
         lambda: single_meta(table=torch.tensor([[4]], dtype=torch.int32), num_blocks=4)),
    Case("MetadataBuilder.build", "num_input_tokens=3 < 4 rows", ValueError,
         r"num_input_tokens \(3\) is smaller than the 4 rows",
         lambda: MetadataBuilder().build(step(), num_input_tokens=3)),
    Case("HeadTail.plan", "pcp_rank=2 of 2", ValueError, r"pcp_rank \(2\) must be in \[0, pcp_size=2\)",
         lambda: HeadTail(2).plan([4], 2)),
    # -- impl constructors -----------------------------------------------------------------
    Case("BaseAttentionImpl", "attn_type='bogus'", ValueError, r"attn_type must be one of .*'bogus'",
         lambda: impl(attn_type="bogus")),
    Case("BaseAttentionImpl", "attn_type='encoder_decoder'", NotImplementedError,
         r"cross-attention\) is not supported", lambda: impl(attn_type="encoder_decoder")),
    Case("BaseAttentionImpl", "num_heads=2, num_kv_heads=3", ValueError,
         r"num_heads \(2\) must be a positive multiple of num_kv_heads \(3\)",
         lambda: impl(num_kv_heads=3)),
    Case("BaseAttentionImpl", "head_size=0", ValueError, r"head_size must be >= 1, got 0",
         lambda: BaseAttentionImpl(num_heads=2, head_size=0, scale=1.0)),
    Case("BaseAttentionImpl", "sliding_window=0", ValueError, r"sliding_window must be >= 1",
         lambda: impl(sliding_window=0)),
    Case("BaseAttentionImpl", "kv_cache_dtype='fp8'", NotImplementedError,
         r"kv_cache_dtype 'fp8' \(quantized KV cache\) is not supported",
         lambda: impl(kv_cache_dtype="fp8")),
    Case("CPAttentionImpl", "groups=None", ValueError, r"CPAttentionImpl needs groups",
         lambda: CPAttentionImpl(num_heads=H, head_size=D, scale=1.0)),
    Case("CPAttentionImpl", "dcp_size=2, num_kv_heads=2 per rank", ValueError,
         r"dcp_size \(2\) > 1 needs one \(replicated\) KV head per rank",
         lambda: CPAttentionImpl(num_heads=H, head_size=D, scale=1.0,
                                 groups=fake_groups(CPConfig(tp_size=2, dcp_size=2)))),
    # -- impl forward: O(1) checks of every call (cp_attention.impl.checks) ---------------
    Case("impl.forward", "output=None", AttentionLayerError, r"output buffer is required",
         lambda: forward(output=None)),
    Case("impl.forward", "output_scale given", NotImplementedError,
         r"fused output quantization is not supported",
         lambda: forward(output_scale=torch.ones(1))),
    Case("impl.forward", "layer._k_scale_float=0.5", NotImplementedError,
         r"layer\._k_scale_float = 0\.5: scaled \(quantized\) K/V", lambda: forward(layer=Layer())),
    Case("impl.forward", "metadata window 8, layer None", AttentionLayerError,
         r"sliding_window=8 but this layer uses None", lambda: forward(meta=single_meta(window=8))),
    Case("impl.forward", "query 3 rows, metadata 4", AttentionLayerError,
         r"query has 3 rows but the metadata was built for num_input_tokens=4",
         lambda: forward(query=torch.randn(3, H, D))),
    Case("impl.forward", "query 4 rows, num_input_tokens 6", AttentionLayerError,
         r"query has 4 rows but the metadata was built for num_input_tokens=6",
         lambda: forward(meta=MetadataBuilder().build(step(), num_input_tokens=6))),
    Case("impl.forward", "key 3 rows, query 4", AttentionLayerError,
         r"key has 3 rows but query has 4", lambda: forward(key=torch.randn(3, H, D))),
    Case("impl.forward", "key with 3 heads", AttentionLayerError,
         r"key rows hold 24 values, expected 2 heads x 8", lambda: forward(key=torch.randn(4, 3, D))),
    Case("impl.forward", "output 4-D", AttentionLayerError,
         r"output must be 2-D or 3-D, got shape \(4, 2, 8, 1\)",
         lambda: forward(output=torch.zeros(4, H, D, 1))),
    Case("impl.forward", "value on device meta", AttentionLayerError,
         r"query, key, value and output must share a device, got cpu, cpu, meta, cpu",
         lambda: forward(value=torch.empty(4, H, D, device="meta"))),
    Case("impl.forward", "key float16, query float32", AttentionLayerError,
         r"dtypes must match floating dtypes, got torch.float32/torch.float16/torch.float32",
         lambda: forward(key=torch.randn(4, H, D, dtype=torch.float16))),
    Case("impl.forward", "output int32", AttentionLayerError, r"output dtype torch.int32 is not one of",
         lambda: forward(output=torch.zeros(4, H, D, dtype=torch.int32))),
    Case("impl.forward", "output is query", AttentionLayerError, r"output must not alias query",
         lambda: (lambda q: forward(query=q, output=q))(torch.randn(4, H, D))),
    Case("impl.forward", "metadata of pcp_rank 0 on pcp_rank 1", AttentionLayerError,
         r"metadata was built for pcp_rank=0, this rank is pcp_rank=1",
         lambda: pcp_forward(impl_rank=1, meta_rank=0)),
    Case("impl.forward", "encoder_only with context", AttentionLayerError,
         r"encoder_only attention takes prefills without context",
         lambda: forward(the_impl=impl(attn_type="encoder_only"), kv_cache=None,
                         meta=single_meta((4,), (4,)))),
    Case("impl.forward", "decoder, kv_cache=None", AttentionLayerError,
         r"decoder attention needs a kv_cache", lambda: forward(kv_cache=None)),
    Case("impl.forward", "kv_cache with 3 KV heads", AttentionLayerError,
         r"kv_cache shape \(2, 4, 16, 3, 8\) must be \(2, num_blocks, block_size, 2, 8\)",
         lambda: forward(kv_cache=torch.zeros(2, 4, BS, 3, D))),
    Case("impl.forward", "kv_cache 4-D", AttentionLayerError, r"kv_cache shape \(2, 4, 16, 16\) must be",
         lambda: forward(kv_cache=torch.zeros(2, 4, BS, H * D))),
    Case("impl.forward", "kv_cache float16, key float32", AttentionLayerError,
         r"kv_cache is torch.float16 on cpu, key is torch.float32",
         lambda: forward(kv_cache=cache(dtype=torch.float16))),
    Case("impl.forward", "kv_cache block_size 8, config 16", AttentionLayerError,
         r"kv_cache block_size 8 != the config's block_size 16",
         lambda: pcp_forward(impl_rank=0, meta_rank=0, kv_cache=cache(block_size=8))),
    # -- impl forward: O(n) checks, debug mode -------------------------------------------
    Case("impl.forward", "NaN in query", AttentionLayerError,
         r"query holds NaN or inf in its first 4 rows",
         lambda: debug_forward(query=torch.full((4, H, D), float("nan"))), "debug"),
    Case("impl.forward", "slot beyond a 1-block kv_cache", AttentionLayerError,
         r"slot_mapping holds slot 32 outside \[-1, 16\)",
         lambda: debug_forward(kv_cache=cache(num_blocks=1),
                               meta=single_meta(table=torch.tensor([[2]]))), "debug"),
    Case("impl.forward", "slot written twice", AttentionLayerError,
         r"slot_mapping writes slot 1 more than once",
         lambda: debug_forward(meta=tampered_meta(step_slot_mapping=torch.tensor([0, 1, 1, 3]))),
         "debug"),
    Case("impl.forward", "context block beyond kv_cache", AttentionLayerError,
         r"ctx_block_table holds block 7 outside the kv_cache's \[0, 4\)",
         lambda: debug_forward(meta=single_meta((16,), (4,), torch.tensor([[7, 1]]))), "debug"),
    Case("impl.forward", "decreasing prefill_cu_seqlens", AttentionLayerError,
         r"metadata prefill_cu_seqlens decreases at index 2: 3 -> 2",
         lambda: debug_forward(meta=tampered_meta(prefill_cu_seqlens=torch.tensor([0, 3, 2, 4]))),
         "debug"),
    # -- ops and backend: O(1) argument checks of every op call -------------------------
    Case("get_ops", "kind='bogus' on cuda", ValueError, r"ops kind must be .* got 'bogus'",
         lambda: get_ops("cuda", "bogus")),
    Case("Mask", "window with causal=False", OpsInputError,
         r"a sliding window requires causal attention", lambda: Mask(causal=False, window=2)),
    Case("Mask", "window=True", OpsInputError, r"window must be an integer >= 1 or None, got True",
         lambda: Mask(causal=True, window=True)),
    Case("ReferenceOps.varlen_attention", "window with causal=False", OpsInputError,
         r"a sliding window requires causal attention",
         lambda: ReferenceOps().varlen_attention(*qkv(), torch.tensor([0, 4]), torch.tensor([0, 4]),
                                                 scale=1.0, causal=False, window=2)),
    Case("CudaOps.varlen_attention", "3 q heads, 2 kv heads", OpsInputError,
         r"q heads \(3\) must be a multiple of k heads \(2\)",
         lambda: CudaOps(use_flash=False).varlen_attention(
             torch.randn(4, 3, D), *qkv()[1:], torch.tensor([0, 4]), torch.tensor([0, 4]),
             scale=1.0, causal=True)),
    Case("NpuOps.varlen_attention", "2 query requests, 1 key request", OpsInputError,
         r"cu_seqlens_q has 2 requests but cu_seqlens_k has 1",
         lambda: NpuOps(kernel_dtypes=None).varlen_attention(
             *qkv(), torch.tensor([0, 2, 4]), torch.tensor([0, 4]), scale=1.0, causal=True)),
    Case("ReferenceOps.paged_attention", "float block_table", OpsInputError,
         r"block_table must be a 2-D integer tensor",
         lambda: ReferenceOps().paged_attention(qkv()[0], *cache(), torch.zeros(1, 1),
                                                torch.tensor([0, 4]), torch.tensor([3]), scale=1.0)),
    Case("NpuOps.varlen_attention", "float32 q, CP_ATTENTION_STRICT_OPS=1", KernelFallbackError,
         r"NpuOps\.varlen_attention: its kernel does not take this call \(q dtype torch\.float32\)",
         lambda: strict(lambda: NpuOps().varlen_attention(
             *qkv(), torch.tensor([0, 4]), torch.tensor([0, 4]), scale=1.0, causal=True))),
    Case("NpuOps.paged_attention", "2 seq_lens, 1 table row", OpsInputError,
         r"block_table has 1 rows, cu_seqlens_q 1 requests, seq_lens 2",
         lambda: NpuOps(kernel_dtypes=None).paged_attention(
             qkv()[0], *cache(), torch.tensor([[0]]), torch.tensor([0, 4]), torch.tensor([1, 1]),
             scale=1.0)),
    Case("ReferenceOps.reshape_and_cache", "3 slots for 4 rows", OpsInputError,
         r"slot_mapping has 3 entries for 4 key rows",
         lambda: ReferenceOps().reshape_and_cache(*qkv()[1:], *cache(), torch.tensor([0, 1, 2]))),
    Case("CudaOps.reshape_and_cache", "float slots", OpsInputError,
         r"slot_mapping must be a 1-D integer tensor",
         lambda: CudaOps(use_flash=False).reshape_and_cache(*qkv()[1:], *cache(), torch.zeros(4))),
    Case("CPAttentionBackend.get_kv_cache_shape", "num_blocks=0", ValueError,
         r"num_blocks must be an integer >= 1, got 0", lambda: CPAttentionBackend.get_kv_cache_shape(0, 16, 1, 8)),
    Case("CPAttentionBackend.get_kv_cache_shape", "head_size=-1", ValueError,
         r"head_size must be an integer >= 1, got -1", lambda: CPAttentionBackend.get_kv_cache_shape(1, 16, 1, -1)),
    # == check functions called directly ==================================================
    Case("validate_ranks", "dcp_rank != tp_rank % dcp_size", StepError,
         r"dcp_rank \(0\) must equal tp_rank % dcp_size = 1 % 2 = 1",
         lambda: validate_ranks(CPConfig(tp_size=2, dcp_size=2), CPRanks(0, 1, 0)), "check"),
    Case("validate_ranks", "tp_rank=2 of 2", StepError, r"tp_rank \(2\) must be an integer in \[0, 2\)",
         lambda: validate_ranks(CPConfig(tp_size=2), CPRanks(0, 2, 0)), "check"),
    Case("validate_step", "block table too short", StepError,
         r"block_table\[0\] has 1 blocks but request 0 needs 2 for 33 tokens \(32 per block\)",
         lambda: validate_step(step((0,), (33,)), CPConfig(pcp_size=2)), "check"),
    Case("validate_step", "negative block id", StepError,
         r"block_table\[0, 0\] = -3 is a negative block id",
         lambda: validate_step(step(table=torch.tensor([[-3]])), CPConfig()), "check"),
    Case("validate_step", "block id >= num_blocks", StepError,
         r"block_table\[1, 1\] = 9 is outside \[0, num_blocks=8\)",
         lambda: validate_step(step((0, 16), (1, 1), torch.tensor([[0, 0], [1, 9]])),
                               CPConfig(), num_blocks=8), "check"),
    Case("validate_step", "num_blocks=0", StepError, r"num_blocks must be an integer >= 1, got 0",
         lambda: validate_step(step(), CPConfig(), num_blocks=0), "check"),
    Case("validate_step", "block listed twice in a request", StepError,
         r"block_table\[0\] lists block 5 twice",
         lambda: validate_step(step((16,), (1,), torch.tensor([[5, 5]])), CPConfig()), "check"),
    Case("validate_step", "block written by two requests", StepError,
         r"block 1 is written by request 0 and also used by request 1",
         lambda: validate_step(step((16, 0), (1, 20), TWO_REQ_TABLE), CPConfig()), "check"),
    Case("validate_slot_mapping", "slot -2", OpsInputError, r"slot -2 outside \[-1, 64\)",
         lambda: validate_slot_mapping(torch.tensor([0, -2]), 64), "check"),
    Case("validate_slot_mapping", "slot 64 of 64", OpsInputError, r"slot 64 outside \[-1, 64\)",
         lambda: validate_slot_mapping(torch.tensor([64]), 64), "check"),
    Case("validate_slot_mapping", "slot 3 twice", OpsInputError, r"writes slot 3 more than once",
         lambda: validate_slot_mapping(torch.tensor([3, -1, 3]), 64), "check"),
    Case("validate_slot_mapping", "3 slots for 4 rows", OpsInputError,
         r"slot_mapping has 3 entries for 4 key rows",
         lambda: validate_slot_mapping(torch.tensor([0, 1, 2]), 64, num_rows=4), "check"),
    Case("validate_slot_mapping", "float slots", OpsInputError,
         r"slot_mapping must be a 1-D integer tensor",
         lambda: validate_slot_mapping(torch.zeros(2), 64), "check"),
    Case("validate_cu_seqlens", "cu[0] = 1", OpsInputError, r"cu_seqlens\[0\] = 1 must be 0",
         lambda: validate_cu_seqlens(torch.tensor([1, 4]), 4), "check"),
    Case("validate_cu_seqlens", "decreasing", OpsInputError,
         r"cu_seqlens decreases at index 2: 3 -> 2",
         lambda: validate_cu_seqlens(torch.tensor([0, 3, 2, 4]), 4), "check"),
    Case("validate_cu_seqlens", "ends at 3 for 4 rows", OpsInputError,
         r"cu_seqlens\[-1\] = 3 but the tensor has 4 rows",
         lambda: validate_cu_seqlens(torch.tensor([0, 3]), 4), "check"),
    Case("validate_varlen_inputs", "2 query requests, 1 key request", OpsInputError,
         r"cu_seqlens_q has 2 requests but cu_seqlens_k has 1",
         lambda: validate_varlen_inputs(*qkv(), torch.tensor([0, 2, 4]), torch.tensor([0, 4])),
         "check"),
    Case("validate_varlen_inputs", "head_size 8 vs 4", OpsInputError,
         r"head_size of q \(8\) != head_size of k \(4\)",
         lambda: validate_varlen_inputs(torch.randn(4, H, D), torch.randn(4, H, 4),
                                        torch.randn(4, H, 4), torch.tensor([0, 4]),
                                        torch.tensor([0, 4])), "check"),
    Case("validate_varlen_inputs", "window=0", OpsInputError, r"window must be an integer >= 1",
         lambda: validate_varlen_inputs(*qkv(), torch.tensor([0, 4]), torch.tensor([0, 4]),
                                        window=0), "check"),
    Case("validate_varlen_inputs", "cu_seqlens_k ends at 3 for 4 keys", OpsInputError,
         r"cu_seqlens_k\[-1\] = 3 but the tensor has 4 rows",
         lambda: validate_varlen_inputs(*qkv(), torch.tensor([0, 4]), torch.tensor([0, 3])),
         "check"),
    Case("validate_varlen_inputs", "seqused_k 5 for a range of 4", OpsInputError,
         r"seqused_k\[0\] = 5 outside \[0, 4\]",
         lambda: validate_varlen_inputs(*qkv(), torch.tensor([0, 4]), torch.tensor([0, 4]),
                                        seqused_k=torch.tensor([5])), "check"),
    Case("validate_varlen_inputs", "seqused_k of 2 requests for 1", OpsInputError,
         r"seqused_k must be a 1-D integer tensor of 1 requests",
         lambda: validate_varlen_inputs(*qkv(), torch.tensor([0, 4]), torch.tensor([0, 4]),
                                        seqused_k=torch.tensor([1, 2])), "check"),
    Case("validate_paged_inputs", "block 9 of 4", OpsInputError,
         r"block_table holds block 9 outside \[0, 4\)",
         lambda: validate_paged_inputs(qkv()[0], *cache(), torch.tensor([[9]]),
                                       torch.tensor([0, 4]), torch.tensor([3])), "check"),
    Case("validate_paged_inputs", "seq_len 17 with 1 block", OpsInputError,
         r"seq_lens\[0\] = 17 needs 2 blocks, block_table has 1",
         lambda: validate_paged_inputs(qkv()[0], *cache(), torch.tensor([[0]]),
                                       torch.tensor([0, 4]), torch.tensor([17])), "check"),
    Case("validate_paged_inputs", "negative seq_len", OpsInputError,
         r"seq_lens holds a negative length -1",
         lambda: validate_paged_inputs(qkv()[0], *cache(), torch.tensor([[0]]),
                                       torch.tensor([0, 4]), torch.tensor([-1])), "check"),
    Case("validate_merge_inputs", "lse shape [4, 3] for out [4, 2, 8]", OpsInputError,
         r"merge needs out \[T, H, D\] and lse \[T, H\] of matching shapes",
         lambda: validate_merge_inputs(torch.zeros(4, 2, 8), torch.zeros(4, 3),
                                       torch.zeros(4, 2, 8), torch.zeros(4, 3)), "check"),
    Case("validate_merge_inputs", "NaN lse", OpsInputError, r"lse_b holds NaN or \+inf",
         lambda: validate_merge_inputs(torch.zeros(4, 2, 8), torch.zeros(4, 2),
                                       torch.zeros(4, 2, 8), torch.full((4, 2), float("nan"))),
         "check"),
    Case("validate_kv_cache_shape_args", "block_size=16.0", ValueError,
         r"block_size must be an integer >= 1, got 16\.0",
         lambda: validate_kv_cache_shape_args(4, 16.0, 1, 8), "check"),
    Case("validate_kv_cache_shape_args", "num_kv_heads=True", ValueError,
         r"num_kv_heads must be an integer >= 1, got True",
         lambda: validate_kv_cache_shape_args(4, 16, True, 8), "check"),
    Case("validate_kv_cache_shape_args", "block_size=24 (unsupported)", ValueError,
         r"block_size 24 is not one of \(16, 32, 64, 128\)",
         lambda: validate_kv_cache_shape_args(4, 24, 1, 8, (16, 32, 64, 128)), "check"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.entry}:{c.input}" for c in CASES])
def test_error(case: Case) -> None:
    with pytest.raises(case.error, match=case.fragment) as info:
        case.call()
    assert type(info.value) is case.error or issubclass(type(info.value), case.error)


def test_valid_inputs_pass_every_check() -> None:
    """The checks accept what the builders produce for healthy steps (debug mode on)."""
    meta = single_meta((16,), (4,), torch.tensor([[0, 1]]))
    debug_forward(meta=meta)
    validate_step(step((16, 0), (1, 20), torch.tensor([[0, 1], [2, 3]])), CPConfig(), 4)
    validate_step(step((16, 16), (1, 1), torch.tensor([[0, 1], [0, 2]])), CPConfig(), 4)
    validate_ranks(CPConfig(tp_size=4, dcp_size=2), CPRanks.of(CPConfig(tp_size=4, dcp_size=2), 3))
    validate_varlen_inputs(*qkv(), torch.tensor([0, 1, 4]), torch.tensor([0, 2, 4]), window=3)
    validate_paged_inputs(qkv()[0], *cache(), torch.tensor([[0, 1]]), torch.tensor([0, 4]),
                          torch.tensor([17]))


def test_step_counts_are_one_read_only_int64_copy() -> None:
    """StepSpec keeps its counts as read-only int64 copies of any integer container."""
    given = np.array([0, 5], dtype=np.int32)
    table = torch.zeros(2, 1, dtype=torch.int32)
    for counts in (given, torch.from_numpy(given), (0, 5), [np.int16(0), 5]):
        spec = StepSpec(counts, (1, 2), table)
        assert spec.num_computed_tokens.dtype == np.int64 and not spec.computed.flags.writeable
        assert spec.num_computed_tokens.tolist() == [0, 5] and spec.seq_lens.tolist() == [1, 7]
    spec = StepSpec(given, given + 1, table)
    given[0] = 9  # the caller's array stays its own
    assert spec.num_computed_tokens.tolist() == [0, 5]


def test_debug_switch_selects_the_value_checks(monkeypatch) -> None:
    """The O(n) checks run only in debug mode; CP_ATTENTION_DEBUG sets the impl's default."""
    nan_query = torch.full((4, H, D), float("nan"))
    forward(query=nan_query)  # debug off: O(1) checks only, no scan of the rows
    with pytest.raises(AttentionLayerError, match="query holds NaN"):
        debug_forward(query=nan_query)
    monkeypatch.setenv("CP_ATTENTION_DEBUG", "1")
    assert BaseAttentionImpl(num_heads=H, head_size=D, scale=1.0).debug is True
    monkeypatch.setenv("CP_ATTENTION_DEBUG", "0")
    assert BaseAttentionImpl(num_heads=H, head_size=D, scale=1.0).debug is False


def test_suite_runs_in_debug_mode() -> None:
    """tests/conftest.py turns the O(n) checks on for every impl the suite builds."""
    assert os.environ.get("CP_ATTENTION_DEBUG") == "1"
    assert BaseAttentionImpl(num_heads=H, head_size=D, scale=1.0).debug is True


def markdown_table() -> str:
    """The table of docs/errors.md, generated from CASES."""
    lines = ["| entry point | input | error | message fragment (regex) | check |",
             "|---|---|---|---|---|"]
    for c in CASES:
        frag = c.fragment.replace("|", "\\|")
        lines.append(f"| `{c.entry}` | {c.input} | `{c.error.__name__}` | `{frag}` | "
                     f"{c.where} |")
    return "\n".join(lines)


def test_docs_table_matches_cases() -> None:
    assert DOC.exists(), "docs/errors.md is missing"
    assert markdown_table() in DOC.read_text(), \
        "docs/errors.md table is stale: regenerate it from tests/test_errors.py:markdown_table()"


if __name__ == "__main__" and os.environ.get("PRINT_TABLE"):
    print(markdown_table())
