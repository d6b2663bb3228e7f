"""PCP attention on real gloo ranks, compared token by token with the float64 oracle.

Each test runs a :class:`Workload` on every rank of a shared pool and checks, per rank: the
largest error of its real output rows against the dense float64 reference of the whole batch,
no NaN, the KV cache holding exactly the tokens the rank owns (zeros elsewhere), and that the
PCP ranks of one TP rank together computed every prefill token exactly once while each of
them computed every decode token.

Tolerances were measured (docs/pcp.md, "Testing"): fp32 errors stay below ~1e-6 and bf16
errors below ~8e-3 on these sizes; the bounds below are about 4-5x that.
"""
from __future__ import annotations

import os
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch

from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.builder import MetadataBuilder
from cp_attention.metadata.common import StepSpec
from cp_attention.testing.workload import RankReport, Workload

pytestmark = pytest.mark.distributed

TASK = "cp_attention.testing.workload.run_workload_task"
TOL = {"float32": 4e-6, "bfloat16": 4e-2}


def run_and_check(pools, w: Workload) -> list[RankReport]:
    """Run ``w`` on a pool of pcp * tp ranks and check every rank's report."""
    cfg = w.config
    reports = pools(cfg.world_size).run(TASK, w, timeout_s=60.0)
    if os.environ.get("CP_ATTN_PRINT_ERRORS"):
        print(f"\n[{w.dtype} pcp={cfg.pcp_size} dcp={cfg.dcp_size}] max_err per rank:",
              [f"{r.max_err:.2e}" for r in reports])
    tol = TOL[w.dtype]
    for rank, rep in enumerate(reports):
        assert not rep.any_nan, f"rank {rank}: NaN in output"
        assert rep.cache_exact, f"rank {rank}: KV cache differs from its owned tokens"
        assert rep.max_err <= tol, f"rank {rank}: max_err {rep.max_err:.3e} > {tol} " \
                                   f"(per step {rep.max_err_per_step})"
        assert len(rep.tokens_per_step) == len(w.steps)
    check_token_coverage(w, reports)
    return reports


def check_token_coverage(w: Workload, reports: list[RankReport]) -> None:
    """Per step and TP rank: the PCP ranks cover every prefill token exactly once; every PCP
    rank computes every decode token (context > 0 and at most decode_threshold new tokens)."""
    cfg = w.config
    computed: dict[int, int] = defaultdict(int)
    for s, step in enumerate(w.steps):
        decode_tokens, prefill_tokens, start = [], [], 0
        for req, new in step:
            tokens = list(range(start, start + new))
            is_decode = computed[req] > 0 and new <= cfg.decode_threshold
            (decode_tokens if is_decode else prefill_tokens).extend(tokens)
            start += new
        expected = Counter(prefill_tokens) + Counter({t: cfg.pcp_size for t in decode_tokens})
        for tp_rank in range(cfg.tp_size):
            got: Counter = Counter()
            for pcp_rank in range(cfg.pcp_size):
                got.update(reports[pcp_rank * cfg.tp_size + tp_rank].tokens_per_step[s])
            assert got == expected, f"step {s}, tp rank {tp_rank}: tokens {got} != {expected}"
        for req, new in step:
            computed[req] += new


# --------------------------------------------------------------------------------------------
# Fixed cases
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
@pytest.mark.parametrize("pcp", [2, 4])
def test_prefill_then_mixed_step(pools, pcp, num_kv_heads, dtype):
    """PrefillNoCache with short (< 2 pcp), 1-token and longer prompts, then a ChunkedPrefill
    step (decodes + a prefix-hit chunk + a new prompt)."""
    w = Workload(CPConfig(pcp_size=pcp), num_heads=4, num_kv_heads=num_kv_heads, dtype=dtype,
                 head_size=32, seed=pcp + num_kv_heads,
                 steps=(((0, 37), (1, 1), (2, 2 * pcp - 1), (3, 64)),
                        ((0, 1), (1, 1), (3, 19), (4, 11))))
    run_and_check(pools, w)


@pytest.mark.parametrize("kv_shard", ["cp", "dcp"])
def test_decodes_anywhere_in_batch_order(pools, kv_shard):
    """Decodes interleaved with prefills in batch order (the planner puts decode rows first)."""
    w = Workload(CPConfig(pcp_size=2, kv_shard=kv_shard), num_heads=4, num_kv_heads=1, seed=2,
                 steps=(((0, 9), (1, 20)), ((2, 13), (0, 1), (1, 7), (3, 1)),
                        ((1, 1), (2, 1), (0, 5))))
    run_and_check(pools, w)


def test_pcp3_odd_lengths(pools):
    w = Workload(CPConfig(pcp_size=3, block_size=16), num_heads=3, num_kv_heads=3, seed=3,
                 steps=(((0, 7), (1, 13), (2, 1), (3, 5), (4, 29)),
                        ((0, 1), (1, 1), (2, 1), (3, 9), (4, 1)),
                        ((0, 1), (3, 1), (4, 17))))
    run_and_check(pools, w)


def test_rank_with_only_padding(pools):
    """pcp=4 and a 3-token prompt: rank 3 holds only pad rows; then it decodes."""
    w = Workload(CPConfig(pcp_size=4), num_heads=2, num_kv_heads=2, seed=5,
                 steps=(((0, 3),), ((0, 1),), ((0, 1), (1, 2)), ((0, 1), (1, 1))))
    reports = run_and_check(pools, w)
    assert reports[3].tokens_per_step[0] == []


@pytest.mark.parametrize("block_size,interleave", [(16, 1), (16, 16), (128, 1), (128, 16)])
def test_block_size_and_interleave(pools, block_size, interleave):
    """Multi-step over block and interleave boundaries (prompt 150 > 128 > 16 x 2 shards)."""
    cfg = CPConfig(pcp_size=2, block_size=block_size, cp_kv_interleave_size=interleave)
    w = Workload(cfg, num_heads=4, num_kv_heads=1, seed=block_size + interleave,
                 steps=(((0, 150), (1, 33)), ((0, 1), (1, 1), (2, 40)),
                        ((0, 1), (1, 70), (2, 1)), ((0, 1), (1, 1), (2, 1))))
    run_and_check(pools, w)


@pytest.mark.parametrize("pcp", [2, 4])
def test_long_prompt_in_three_chunks_then_decodes(pools, pcp):
    """A 4096-token prompt prefilled in 3 chunks (PrefillNoCache, then PrefillCacheHit twice),
    then 8 decodes."""
    chunks = (((0, 1366),), ((0, 1365),), ((0, 1365),))
    w = Workload(CPConfig(pcp_size=pcp, block_size=128), num_heads=2, num_kv_heads=2,
                 head_size=32, seed=11, steps=chunks + (((0, 1),),) * 8)
    reports = run_and_check(pools, w)
    # Step 0 (no context) moves only the K/V all-gather: each rank sends its 2c local rows
    # (K and V, 2 heads x 32 fp32) to the pcp - 1 others: (pcp-1)/pcp x the padded KV bytes.
    local_rows = 2 * -(-1366 // (2 * pcp))
    for rep in reports:
        assert rep.comm_bytes_per_step[0] == (pcp - 1) * local_rows * 2 * 2 * 32 * 4


@pytest.mark.parametrize("kv_shard", ["dcp", "cp"])
def test_pcp_with_dcp(pools, kv_shard):
    """pcp=2 x dcp=2 (tp=2): cache sharded over the 4 CP ranks ("cp") or over DCP only."""
    cfg = CPConfig(pcp_size=2, dcp_size=2, tp_size=2, kv_shard=kv_shard)
    w = Workload(cfg, num_heads=4, num_kv_heads=1, seed=7,
                 steps=(((0, 21), (1, 4)), ((0, 1), (1, 1), (2, 30)), ((0, 1), (1, 9), (2, 1))))
    run_and_check(pools, w)


def test_kv_shard_dcp_without_dcp(pools):
    """kv_shard="dcp" with dcp=1: every PCP rank stores the whole sequence (vLLM's layout)."""
    cfg = CPConfig(pcp_size=2, kv_shard="dcp")
    w = Workload(cfg, num_heads=4, num_kv_heads=4, seed=9,
                 steps=(((0, 45), (1, 2)), ((0, 1), (1, 1), (2, 12)), ((0, 5), (1, 1), (2, 1))))
    run_and_check(pools, w)


# --------------------------------------------------------------------------------------------
# Sliding window: the window-aware exchange (halos and the shard's rows, not the all-gather)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pcp, window, kv_shard, window_cache", [
    (2, 5, "cp", "all"),  # a window inside a chunk
    (2, 5, "dcp", "window"),
    (2, 70, "cp", "window"),  # a window over several chunks
    (2, 70, "dcp", "all"),
    (4, 9, "cp", "window"),
    (4, 33, "dcp", "all"),
    (4, 33, "cp", "all"),
])
def test_window_exchange(pools, pcp, window, kv_shard, window_cache):
    """Prompts shorter than 2 pcp, of one token and longer than the window; then a chunk over
    cached context beside decodes and a new prompt; then decodes (every later read of the
    window is exact, whichever rows the cache kept). Step 0 moves only the window exchange:
    (pcp - 1) equal parts of the plan's rows, less than the all-gather's."""
    cfg = CPConfig(pcp_size=pcp, kv_shard=kv_shard, window_cache=window_cache)
    steps = (((0, 2 * pcp - 1), (1, 1), (2, 150), (3, 37)),
             ((0, 1), (1, 1), (2, 61), (3, 1), (4, 23)),
             ((0, 1), (1, 1), (2, 1), (3, 1), (4, 1)))
    w = Workload(cfg, steps, num_heads=4, num_kv_heads=2, head_size=16, seed=pcp + window,
                 sliding_window=window)
    reports = run_and_check(pools, w)
    builder = MetadataBuilder(cfg, CPRanks(), sliding_window=window)
    spec = StepSpec((0,) * 4, tuple(n for _, n in steps[0]),
                    torch.zeros(4, 16, dtype=torch.int32))
    rows = len(builder.build(spec).window_send_idx)
    local_rows = 2 * sum(-(-n // (2 * pcp)) for _, n in steps[0])
    assert rows < local_rows
    for rep in reports:
        assert rep.comm_bytes_per_step[0] == (pcp - 1) * rows * 2 * 2 * 16 * 4


# --------------------------------------------------------------------------------------------
# Randomized multi-step batches
# --------------------------------------------------------------------------------------------
@st.composite
def workloads(draw) -> Workload:
    """3-4 steps, each one of PrefillNoCache / PrefillCacheHit / DecodeOnly / ChunkedPrefill,
    with random sizes, layout, GQA ratio and dtype (decodes first in each step, as vLLM)."""
    pcp = draw(st.sampled_from([2, 4]))
    block_size = draw(st.sampled_from([16, 128]))
    cfg = CPConfig(pcp_size=pcp, block_size=block_size,
                   cp_kv_interleave_size=draw(st.sampled_from([1, 16])),
                   kv_shard=draw(st.sampled_from(["cp", "dcp"])))
    computed: dict[int, int] = {}
    steps = []
    for _ in range(draw(st.integers(3, 4))):
        kind = draw(st.sampled_from(["no_cache", "cache_hit", "decode", "chunked"]))
        started = sorted(computed)
        if kind in ("decode", "cache_hit", "chunked") and not started:
            kind = "no_cache"
        step: list[tuple[int, int]] = []
        if kind in ("decode", "chunked"):
            step += [(r, 1) for r in started
                     if draw(st.booleans()) or r == started[0]]
        if kind in ("cache_hit", "chunked"):
            taken = {r for r, _ in step}
            rest = [r for r in started if r not in taken]
            if rest:
                step.append((rest[0], draw(st.integers(2, 70))))
        if kind in ("no_cache", "chunked") or not step:
            for _ in range(draw(st.integers(1, 3))):
                step.append((len(computed) + sum(1 for r, _ in step if r not in computed),
                             draw(st.integers(1, 90))))
        for r, n in step:
            computed[r] = computed.get(r, 0) + n
        steps.append(tuple(step))
    num_heads = 4
    return Workload(cfg, steps=tuple(steps), num_heads=num_heads,
                    num_kv_heads=draw(st.sampled_from([num_heads, num_heads // 4])),
                    head_size=32, dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                    seed=draw(st.integers(0, 1000)))


@settings(max_examples=8, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(w=workloads())
def test_random_multistep_workloads(pools, w):
    run_and_check(pools, w)


@pytest.mark.parametrize("window", [None, 6])
def test_a_layer_enters_each_step_module_once(pools, window):
    """A PCP x DCP layer (prefill with context, mixed steps, decodes) enters the self-part and
    context modules in one run each: base orchestrates, no module returns to one it left."""
    cfg = CPConfig(pcp_size=2, tp_size=2, dcp_size=2)
    steps = (((0, 37), (1, 9)), ((0, 1), (1, 20), (2, 30)), ((0, 1), (1, 1), (2, 1)))
    w = Workload(cfg, steps, num_heads=4, num_kv_heads=1, head_size=16, sliding_window=window)
    entered = []
    for visits in pools(cfg.world_size).run("numerics_tasks.module_visits_task", w):
        assert len(visits) == len(steps)
        for modules in visits:
            entered.append([m for m in modules if m not in ("base", "checks")])
            steps_entered = [m for m in modules if m not in ("base", "checks")]
            assert steps_entered in (["self_part", "context"], ["self_part"], ["context"]), modules
            assert all(modules.count(m) <= 1 for m in ("self_part", "context", "checks")), modules
    assert ["self_part", "context"] in entered and ["context"] in entered  # both paths ran
