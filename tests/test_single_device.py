"""Single-device backend: every attention state and multi-step runs against the fp64 oracle."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cp_attention import (AttentionMetadata, AttentionState, CPAttentionBackend, CPConfig,
                          CPRanks, MetadataBuilder, StepSpec)
from cp_attention.errors import AttentionLayerError
from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.metadata.vllm_ascend import VllmAscendView
from cp_attention.ops.reference import ReferenceOps
from cp_attention.testing.workload import Workload, run_workload

TOL = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 4e-3}


def _run(steps, dtype="float32", **kw):
    config = CPConfig(block_size=kw.pop("block_size", 16), decode_threshold=kw.pop("threshold", 1))
    rep = run_workload(Workload(config, tuple(steps), dtype=dtype, **kw))
    assert not rep.any_nan and rep.cache_exact
    return rep


STATE_STEPS = {
    AttentionState.PrefillNoCache: [((0, 37), (1, 5), (2, 1))],
    AttentionState.PrefillCacheHit: [((0, 20), (1, 16)), ((0, 13), (1, 40))],
    AttentionState.DecodeOnly: [((0, 20), (1, 3)), ((0, 1), (1, 1))],
    AttentionState.ChunkedPrefill: [((0, 20), (1, 3)), ((0, 1), (1, 30), (2, 17))],
    AttentionState.SpecDecoding: [((0, 20), (1, 3)), ((0, 4), (1, 2))],
}


@pytest.mark.parametrize("state", list(STATE_STEPS), ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_each_state_matches_reference(state, dtype, num_kv_heads):
    steps = STATE_STEPS[state]
    threshold = 4 if state == AttentionState.SpecDecoding else 1
    config = CPConfig(decode_threshold=threshold)
    last = steps[-1]
    computed = {}
    for step in steps[:-1]:
        for r, n in step:
            computed[r] = computed.get(r, 0) + n
    spec = StepSpec(tuple(computed.get(r, 0) for r, _ in last), tuple(n for _, n in last),
                    torch.zeros(len(last), 8, dtype=torch.int32))
    assert VllmAscendView(MetadataBuilder(config).build(spec)).attn_state == state
    rep = _run(steps, dtype, threshold=threshold, num_heads=4, num_kv_heads=num_kv_heads)
    assert rep.max_err <= TOL[dtype]


@pytest.mark.parametrize("window", [1, 6, 64])
def test_sliding_window_prefill_and_decode(window):
    steps = [((0, 50), (1, 9)), ((0, 1), (1, 1)), ((0, 20), (1, 1)), ((0, 1),)]
    rep = _run(steps, sliding_window=window, num_kv_heads=2)
    assert rep.max_err <= TOL["float32"]


def test_encoder_only_is_bidirectional():
    rep = run_workload(Workload(CPConfig(), (((0, 33), (1, 1), (2, 7)),), encoder_only=True))
    assert rep.max_err <= TOL["float32"] and not rep.any_nan


@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_multistep_runs(data):
    num_reqs = data.draw(st.integers(1, 5))
    steps, started = [], set()
    for _ in range(data.draw(st.integers(1, 5))):
        reqs = data.draw(st.lists(st.integers(0, num_reqs - 1), min_size=1, max_size=num_reqs,
                                  unique=True))
        step = []
        for r in reqs:
            new = data.draw(st.integers(1, 3)) if r in started and data.draw(st.booleans()) \
                else data.draw(st.integers(1, 70))
            step.append((r, new))
            started.add(r)
        steps.append(tuple(step))
    block = data.draw(st.sampled_from([16, 128]))
    rep = _run(steps, block_size=block, threshold=3, num_kv_heads=data.draw(st.sampled_from([1, 4])))
    assert rep.max_err <= TOL["float32"]


def test_prefill_then_decodes_then_chunked_prefill():
    steps = [((0, 300),)] + [((0, 1),)] * 6 + [((0, 1), (1, 100)), ((0, 1), (1, 100)), ((1, 1),)]
    rep = _run(steps, block_size=16, num_heads=8, num_kv_heads=2)
    assert rep.max_err <= TOL["float32"]
    assert len(rep.max_err_per_step) == len(steps)


def test_graph_capture_padding_zeroes_extra_rows():
    config = CPConfig()
    builder = MetadataBuilder(config)
    # a graph-capture dummy batch: 4 one-token decodes
    meta = builder.build(StepSpec((1,) * 4, (1,) * 4, torch.zeros(4, 1, dtype=torch.int32)))
    assert VllmAscendView(meta).attn_state == AttentionState.DecodeOnly and meta.num_local_rows == 4
    spec = StepSpec((3, 5), (1, 1), torch.tensor([[0], [1]], dtype=torch.int32))
    meta = builder.build(spec, num_input_tokens=8)
    assert meta.num_input_tokens == 8 and meta.local_token_idx.tolist()[2:] == [-1] * 6
    impl = BaseAttentionImpl(num_heads=2, head_size=8, scale=0.3)
    cache = torch.randn(CPAttentionBackend.get_kv_cache_shape(2, 16, 2, 8))
    q = torch.randn(8, 2, 8)
    out = torch.full_like(q, 7.0)
    impl.forward(None, q, q[:, :2], q[:, :2], cache, meta, output=out)
    assert (out[2:] == 0).all() and not (out[:2] == 7.0).any()
    with pytest.raises(ValueError, match="num_input_tokens"):
        builder.build(spec, num_input_tokens=1)


def test_backend_surface_and_routing():
    backend = CPAttentionBackend
    assert backend.get_name() == "CP_ATTENTION"
    assert backend.get_metadata_cls() is AttentionMetadata
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    from cp_attention import CPAttentionImpl
    assert backend.get_impl_cls(CPConfig()) is BaseAttentionImpl
    assert backend.get_builder_cls() is MetadataBuilder
    assert backend.get_impl_cls(CPConfig(pcp_size=2)) is CPAttentionImpl
    assert backend.get_impl_cls(CPConfig(tp_size=2, dcp_size=2)) is CPAttentionImpl
    with pytest.raises(ValueError, match="num_blocks"):
        backend.get_kv_cache_shape(0, 16, 2, 64)


def _layer_inputs():
    builder = MetadataBuilder(CPConfig())
    meta = builder.build(StepSpec((0,), (5,), torch.zeros(1, 1, dtype=torch.int32)))
    q = torch.randn(5, 2, 8)
    cache = torch.zeros(2, 2, 16, 2, 8)
    return meta, q, cache


def test_forward_guards():
    meta, q, cache = _layer_inputs()
    impl = BaseAttentionImpl(num_heads=2, head_size=8, scale=0.3)
    with pytest.raises(AttentionLayerError, match="output buffer is required"):
        impl.forward(None, q, q, q, cache, meta)
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(None, q, q, q, cache, meta, output=q.clone(), output_scale=torch.ones(1))

    class Layer:
        _k_scale_float = 0.5
        _v_scale_float = 1.0
    with pytest.raises(NotImplementedError, match="_k_scale_float"):
        impl.forward(Layer(), q, q, q, cache, meta, output=q.clone())
    with pytest.raises(NotImplementedError, match="cross-attention"):
        BaseAttentionImpl(num_heads=2, head_size=8, scale=0.3, attn_type="encoder_decoder")
    with pytest.raises(AttentionLayerError, match="kv_cache shape"):
        impl.forward(None, q, q, q, torch.zeros(2, 2, 16, 3, 8), meta, output=q.clone())
    with pytest.raises(AttentionLayerError, match="sliding_window"):
        BaseAttentionImpl(num_heads=2, head_size=8, scale=0.3, sliding_window=4).forward(
            None, q, q, q, cache, meta, output=q.clone())
    with pytest.raises(AttentionLayerError, match="needs a kv_cache"):
        impl.forward(None, q, q, q, None, meta, output=q.clone())


def test_cp_routing_needs_groups():
    from cp_attention import CPAttentionImpl
    with pytest.raises(ValueError, match="needs groups"):
        CPAttentionImpl(num_heads=2, head_size=8, scale=0.3)


def test_decode_only_step_plans_one_paged_pass():
    table = torch.zeros(2, 1, dtype=torch.int32)
    spec = StepSpec((5, 9), (1, 3), table)
    plan = MetadataBuilder(CPConfig(decode_threshold=3), sliding_window=4).build(spec)
    assert plan.single_pass
    assert plan.single_pass_seq_lens.tolist() == [6, 12]  # the cache after this step's write
    # bottom-right causal: positions 5, 9, 10, 11; window 4: keys p - 3 .. p
    assert plan.single_pass_kv_end.tolist() == [6, 10, 11, 12]
    assert plan.single_pass_kv_start.tolist() == [2, 6, 7, 8]
    plain = MetadataBuilder(CPConfig()).build(StepSpec((5, 9), (1, 1), table))
    assert plain.single_pass and plain.single_pass_seq_lens.tolist() == [6, 10]
    assert plain.single_pass_kv_start is None and plain.single_pass_kv_end is None
    with_prefill = MetadataBuilder(CPConfig()).build(StepSpec((5, 0), (1, 4), table))
    assert not with_prefill.single_pass and with_prefill.single_pass_seq_lens is None
    dcp = CPConfig(tp_size=2, dcp_size=2, decode_threshold=3)
    shard = MetadataBuilder(dcp, CPRanks.of(dcp, 1)).build(spec)
    assert shard.single_pass_seq_lens.tolist() == [3, 6]  # odd positions live on DCP rank 1
    assert shard.single_pass_kv_start is None
    assert shard.single_pass_kv_end.tolist() == [3, 5, 5, 6]
    pcp = CPConfig(pcp_size=2, decode_threshold=3)  # the cache is sharded over PCP ranks too
    over_pcp = MetadataBuilder(pcp, CPRanks.of(pcp, 1)).build(spec)
    assert over_pcp.ctx_over_pcp and over_pcp.single_pass_seq_lens.tolist() == [3, 6]
    mixed = MetadataBuilder(pcp, CPRanks()).build(StepSpec((5, 0), (1, 4), table))
    assert not mixed.single_pass  # prefill queries are gathered over PCP: general plan


def test_decode_only_forward_is_one_write_and_one_paged_call():
    calls = []

    class CountingOps(ReferenceOps):
        def __getattribute__(self, name):
            if name in ("varlen_attention", "paged_attention", "reshape_and_cache",
                        "merge_attn_states", "cache_and_paged_attention"):
                calls.append(name)
            return super().__getattribute__(name)

    config = CPConfig(block_size=4, decode_threshold=2)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    cache = torch.randn(2, 6, 4, 1, 8)
    q, kv = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    impl = BaseAttentionImpl(num_heads=2, head_size=8, scale=0.3, num_kv_heads=1,
                             ops=CountingOps())
    meta = MetadataBuilder(config).build(StepSpec((6, 9), (1, 2), table))
    out = impl.forward(None, q, kv, kv, cache, meta, output=torch.empty_like(q))
    assert calls == ["cache_and_paged_attention", "reshape_and_cache", "paged_attention"]
    # the same rows through the general plan (self part + context part, merged by LSE)
    calls.clear()
    fresh = cache.clone()
    general = dataclasses.replace(meta, single_pass=False)
    expected = impl.forward(None, q, kv, kv, fresh, general, output=torch.empty_like(q))
    assert "merge_attn_states" in calls
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(cache, fresh)
