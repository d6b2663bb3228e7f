"""DCP and PCP x DCP attention on gloo ranks, checked token by token against the fp64 oracle.

Every test runs a :class:`Workload` on a pool of ranks; each rank compares every output row it
computes with :func:`dense_attention` (float64) and its whole KV cache, exactly, with the
tokens it owns. Configurations are (pcp, tp, dcp); DCP needs each KV head replicated over a
multiple of dcp TP ranks (``CPConfig.validate_heads``), hence ``num_kv_heads=1`` throughout.
"""
from __future__ import annotations

import pytest

from cp_attention.config import CPConfig
from cp_attention.testing.workload import Workload, run_workload

pytestmark = pytest.mark.distributed

TASK = "cp_attention.testing.workload.run_workload_task"
# Observed worst max_err over this file: fp32 9.6e-7, bf16 7.8e-3 (bf16: half an ulp of outputs
# in [2, 4) after the final rounding to bf16). Tolerances are ~5x those.
TOLERANCE = {"float32": 5e-6, "bfloat16": 4e-2}


# -- workloads ------------------------------------------------------------------------------
def multi_step_steps(lengths: list[int], decodes: int = 16, spec_tokens: int = 4,
                     chunk: int = 37, new_prompt: int = 23) -> tuple:
    """Prefill all requests, ``decodes`` single-token steps, one speculative step
    (``spec_tokens`` new tokens per request), then a chunked-prefill step: decodes of all but
    request 0 first, a ``chunk``-token chunk of request 0 and a new request's prompt."""
    reqs = range(len(lengths))
    steps = [tuple((r, n) for r, n in zip(reqs, lengths))]
    steps += [tuple((r, 1) for r in reqs)] * decodes
    steps.append(tuple((r, spec_tokens) for r in reqs))
    steps.append(tuple((r, 1) for r in reqs if r) + ((0, chunk), (len(lengths), new_prompt)))
    return tuple(steps)


def run_checked(pools, w: Workload) -> list:
    """Run on every rank; assert accuracy, no NaN, exact caches and full token coverage."""
    cfg = w.config
    reports = pools(cfg.world_size).run(TASK, w)
    tol = TOLERANCE[w.dtype]
    for rep in reports:
        assert len(rep.max_err_per_step) == len(w.steps)
        assert rep.max_err <= tol, (rep.rank, rep.max_err_per_step)
        assert not rep.any_nan, rep.rank
        assert rep.cache_exact, rep.rank
    # Token by token: for each TP slot, its PCP ranks together computed every new token.
    for step_no, step in enumerate(w.steps):
        expected = list(range(sum(n for _, n in step)))
        for tp_rank in range(cfg.tp_size):
            done = set()
            for pcp_rank in range(cfg.pcp_size):
                done |= set(reports[pcp_rank * cfg.tp_size + tp_rank].tokens_per_step[step_no])
            assert sorted(done) == expected, (step_no, tp_rank)
    return reports


def config(pcp: int, tp: int, dcp: int, **kwargs) -> CPConfig:
    return CPConfig(pcp_size=pcp, tp_size=tp, dcp_size=dcp, decode_threshold=4, **kwargs)


# -- correctness matrix: (pcp, tp, dcp) x GQA ratio x interleave x block x dtype ------------
MATRIX = [
    # (pcp, tp, dcp), num_heads (ratio), interleave, block, dtype
    ((1, 2, 2), 4, 1, 16, "float32"),
    ((1, 2, 2), 8, 16, 128, "bfloat16"),
    ((1, 4, 2), 4, 16, 16, "bfloat16"),
    ((1, 4, 2), 8, 1, 128, "float32"),
    ((2, 2, 2), 4, 1, 128, "bfloat16"),
    ((2, 2, 2), 8, 16, 16, "float32"),
    ((1, 4, 4), 4, 16, 128, "float32"),
    ((1, 4, 4), 8, 1, 16, "bfloat16"),
]


@pytest.mark.parametrize("sizes, heads, interleave, block, dtype", MATRIX,
                         ids=lambda v: str(v).replace(" ", ""))
def test_multi_step_matches_oracle(pools, sizes, heads, interleave, block, dtype):
    """Prefill, 16 decodes, a k=3 speculative step, a chunked prefill; lengths 1 and 3 leave
    some CP ranks without any cached token of the request."""
    cfg = config(*sizes, block_size=block, cp_kv_interleave_size=interleave)
    w = Workload(cfg, multi_step_steps([1, 3, 17, 130, 300]), num_heads=heads, num_kv_heads=1,
                 head_size=16, dtype=dtype, seed=sum(sizes) + heads + interleave)
    run_checked(pools, w)


@pytest.mark.parametrize("sizes, heads, kv_heads, kv_shard, interleave", [
    ((2, 2, 2), 4, 1, "dcp", 16),  # vLLM's layout: PCP ranks keep the whole DCP shard
    ((1, 4, 2), 8, 2, "cp", 4),  # two KV heads, each replicated over one DCP group
])
def test_vllm_layout_and_two_kv_heads(pools, sizes, heads, kv_heads, kv_shard, interleave):
    cfg = config(*sizes, block_size=16, cp_kv_interleave_size=interleave, kv_shard=kv_shard)
    w = Workload(cfg, multi_step_steps([1, 2, 33, 250], decodes=4), num_heads=heads,
                 num_kv_heads=kv_heads, head_size=16, dtype="float32", sliding_window=None,
                 seed=19)
    run_checked(pools, w)


@pytest.mark.parametrize("sizes, dtype", [((1, 2, 2), "bfloat16"), ((1, 4, 4), "float32"),
                                          ((2, 2, 2), "float32")])
def test_dcp_a2a_combine_matches_oracle(pools, sizes, dtype):
    """dcp_comm_backend="a2a": one all-to-all of packed [out | lse] per head slice instead of
    all-gather LSE + reduce-scatter; same accuracy, and the run really takes the a2a path."""
    cfg = config(*sizes, block_size=16, cp_kv_interleave_size=1)
    w = Workload(cfg, multi_step_steps([1, 3, 40, 130], decodes=4), num_heads=8,
                 num_kv_heads=1, head_size=16, dtype=dtype, seed=23, dcp_comm_backend="a2a")
    for rep in run_checked(pools, w):
        assert rep.comm_calls.get("reduce_scatter", 0) == 0, rep.comm_calls
        assert rep.comm_calls.get("all_to_all", 0) > 0, rep.comm_calls


def test_batch_of_one(pools):
    cfg = config(1, 4, 4, block_size=16, cp_kv_interleave_size=1)
    w = Workload(cfg, multi_step_steps([700], decodes=16), num_heads=8, num_kv_heads=1,
                 head_size=16, dtype="float32", seed=7)
    run_checked(pools, w)


def test_batch_of_64_contexts_1_to_8k(pools):
    """64 requests, contexts 1..8192 (geometric; some shorter than cp_world = 4). Long
    prompts are prefilled in 2048-token chunks next to the short requests' decodes, then
    two decode steps over all 64 requests."""
    short = sorted({max(1, round(1.13 ** i)) for i in range(80)})[:60]  # 1, 2, 3, ..., 4596
    lengths = short + [2048, 3000, 5000, 8192]
    assert len(lengths) == 64 and min(lengths) == 1 and max(lengths) == 8192
    chunk = 2048
    steps = [tuple((r, min(n, chunk)) for r, n in enumerate(lengths))]
    left = [max(0, n - chunk) for n in lengths]
    while any(left):
        decodes = tuple((r, 1) for r in range(64) if not left[r])
        chunks = tuple((r, min(chunk, left[r])) for r in range(64) if left[r])
        steps.append(decodes + chunks)  # decodes first, as the scheduler orders them
        left = [max(0, n - chunk) for n in left]
    steps += [tuple((r, 1) for r in range(64))] * 2
    cfg = config(1, 4, 4, block_size=128, cp_kv_interleave_size=1)
    w = Workload(cfg, tuple(steps), num_heads=4, num_kv_heads=1, head_size=16,
                 dtype="float32", seed=64)
    run_checked(pools, w)


# -- sliding window and speculative queries with empty local ranges -------------------------
@pytest.mark.parametrize("sizes, interleave, window, dtype", [
    ((1, 4, 2), 16, 37, "float32"),
    ((2, 2, 2), 1, 19, "bfloat16"),
])
def test_sliding_window(pools, sizes, interleave, window, dtype):
    cfg = config(*sizes, block_size=16, cp_kv_interleave_size=interleave)
    w = Workload(cfg, multi_step_steps([1, 3, 40, 130, 300], decodes=4), num_heads=4,
                 num_kv_heads=1, head_size=16, dtype=dtype, sliding_window=window, seed=3)
    run_checked(pools, w)


@pytest.mark.parametrize("sizes", [(1, 4, 4), (2, 2, 2)])
@pytest.mark.parametrize("window", [None, 3])
def test_speculative_queries_with_empty_local_range(pools, sizes, window):
    """cp_world 4, interleave 16: contexts under 16 tokens live on one rank only, and with a
    3-token window most ranks see no cached token for any of the 4 speculative queries."""
    cfg = config(*sizes, block_size=16, cp_kv_interleave_size=16)
    steps = (((0, 3), (1, 5), (2, 20)),  # prefill
             ((0, 4), (1, 4), (2, 4)),  # spec decode: 4 queries per request
             ((0, 1), (1, 1), (2, 1)),
             ((0, 4), (1, 4), (2, 4)))
    w = Workload(cfg, steps, num_heads=4, num_kv_heads=1, head_size=16, dtype="float32",
                 sliding_window=window, seed=11)
    run_checked(pools, w)


# -- GQA constraint ---------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, heads, kv_heads", [((1, 2, 2), 2, 2), ((1, 4, 2), 4, 4),
                                                    ((1, 4, 4), 8, 2)])
def test_dcp_rejects_kv_heads_not_replicated_over_dcp(sizes, heads, kv_heads):
    """Query heads gathered over a DCP group must share one KV head: tp // num_kv_heads has to
    be a multiple of dcp. GQA ratio 1 (num_heads == num_kv_heads == tp) breaks it."""
    cfg = config(*sizes)
    with pytest.raises(ValueError, match="replicated on a multiple of dcp_size"):
        cfg.validate_heads(heads, kv_heads)
    w = Workload(cfg, (((0, 8),),), num_heads=heads, num_kv_heads=kv_heads)
    with pytest.raises(ValueError, match="dcp_size"):
        run_workload(w, rank=0)  # rejected before any process group is needed


# -- communication per decode step is independent of the context length -------------------
def decode_comm_bytes(cfg: CPConfig, tokens: int, heads: int, head_size: int,
                      q_bytes: int) -> int:
    """Bytes one rank sends per decode step (ring accounting of :class:`Communicator`).

    DCP: all-gather Q heads, all-gather LSE (fp32), reduce-scatter fp32 outputs; PCP (KV
    sharded over PCP too): one all-to-all of packed fp32 [out | lse].
    """
    n, h = cfg.dcp_size, heads // cfg.tp_size
    dcp = (n - 1) * tokens * h * (head_size * (q_bytes + 4) + 4 * n) if n > 1 else 0
    pcp = cfg.pcp_size
    a2a = (pcp - 1) * tokens * h * (head_size + 1) * 4 if pcp > 1 and cfg.kv_shard == "cp" else 0
    return dcp + a2a


@pytest.mark.parametrize("sizes, long_context", [((1, 2, 2), 65536), ((2, 2, 2), 8192)])
def test_decode_comm_bytes_independent_of_context(pools, sizes, long_context):
    """Same bytes per decode step for 1k and ``long_context`` tokens (one request, head_size
    16, one KV head; the long prompt is prefilled in one unchecked step)."""
    cfg = config(*sizes, block_size=128)
    per_context = {}
    for context in (1024, long_context):
        w = Workload(cfg, (((0, context),), ((0, 1),), ((0, 1),), ((0, 4),)), num_heads=cfg.tp_size,
                     num_kv_heads=1,
                     head_size=16, dtype="float32", seed=5)
        check = context <= 1024  # the 64k oracle would need a 64k x 64k matrix
        reports = pools(cfg.world_size).run(TASK, w, check, timeout_s=300)
        for rep in reports:
            if check:
                assert rep.max_err <= TOLERANCE["float32"] and rep.cache_exact
            assert not rep.any_nan
        per_context[context] = [rep.comm_bytes_per_step[1:] for rep in reports]
    assert per_context[1024] == per_context[long_context]
    heads = cfg.tp_size
    for rank_bytes in per_context[1024]:
        assert rank_bytes == [decode_comm_bytes(cfg, t, heads, 16, 4) for t in (1, 1, 4)]
