"""End to end in a real vLLM (CPU): vLLM's CPU_ATTN vs cp_attention at tp=1 and tp=2 dcp=2
(combine `ag_rs` and `a2a`, vLLM's --dcp-comm-backend); PCP runs: test_e2e_pcp.py.

Each configuration runs in a fresh subprocess (``run_llm.py``) on a tiny Llama with random
weights (4 query heads, 1 KV head, head_dim 32), greedy fp32, block size 32, 4 prompts given
as token ids. Scheduling (max_num_seqs=3, 64 batched tokens, per-request max_tokens) makes the
run contain: a first step of three prefills (8, 37 and the first 19 tokens of 100); a chunked
prefill whose later chunks (63, then 18 tokens) attend cached (DCP-sharded) context next to
decodes; a one-token prompt; prompts crossing block boundaries. Request 0 ends after its
prefill, so vLLM moves the chunked prefill into batch slot 0 ahead of a decode: with
``CP_ATTENTION_VLLM_REORDER=0`` (vLLM keeps that order; run at dcp=2, the gather/scatter being
the same code at tp=1) our rows are a permutation of vLLM's and the gather/scatter path runs;
by default vLLM reorders decodes first and the orders agree.
"""
from __future__ import annotations

import json

import pytest

from harness import (CP, MULTI_WORKER, RunSpec, Runs, greedy_margins,  # sibling modules
                     max_logprob_diff, tokens)
from tiny_model import make_tiny_llama

pytestmark = pytest.mark.vllm

PROMPTS = [
    [1, 17, 42, 99, 5, 7, 200, 3],  # 8 tokens
    list(range(3, 40)),  # 37: crosses the 32-token block boundary
    [(7 * i + 3) % 256 for i in range(100)],  # 100: chunks of 19, 63, 18 with a 64-token budget
    [5],  # one token, no context
]
MAX_TOKENS = [1, 12, 12, 12]  # request 0 finishes at once, freeing batch slot 0
LOGPROB_TOL = 1e-3  # |logprob(ours) - logprob(vLLM CPU_ATTN)| for the returned top-2 tokens
MIN_MARGIN = 5e-3  # greedy top-1 minus top-2 logprob, every step of the reference run
MARGIN_OVER_DIFF = 10.0  # margins must exceed the largest logprob difference by this factor

NO_REORDER = {"CP_ATTENTION_VLLM_REORDER": "0"}
DCP2 = ("--tp", "2", "--dcp", "2")
RUNS = {
    "cpu_attn_tp1": RunSpec(),
    "cp_tp1": RunSpec(CP),
    "cp_tp2_dcp2": RunSpec({**CP, **MULTI_WORKER}, DCP2),
    "cp_tp2_dcp2_il16_noreorder": RunSpec({**CP, **MULTI_WORKER, **NO_REORDER},
                                          DCP2 + ("--interleave", "16")),
    "cp_tp2_dcp2_a2a": RunSpec({**CP, **MULTI_WORKER}, DCP2 + ("--dcp-comm-backend", "a2a")),
    "cp_tp2_dcp2_fault": RunSpec({**CP, **MULTI_WORKER}, DCP2, fault="skip_dcp_combine"),
}
REFERENCE = "cpu_attn_tp1"
OURS = ["cp_tp1", "cp_tp2_dcp2", "cp_tp2_dcp2_il16_noreorder", "cp_tp2_dcp2_a2a"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("vllm_e2e")
    common = ["--block-size", "32", "--max-num-seqs", "3", "--max-batched", "64",
              "--logprobs", "2", "--max-tokens", json.dumps(MAX_TOKENS),
              "--prompts", json.dumps(PROMPTS)]
    return Runs({"default": make_tiny_llama(root / "tiny_llama")}, root, RUNS, common)


def test_reference_generates_expected_lengths(runs):
    ref = runs.get(REFERENCE)
    assert [r["prompt_len"] for r in ref["requests"]] == [len(p) for p in PROMPTS]
    assert [len(t) for t in tokens(ref)] == MAX_TOKENS
    assert "cp_attention impl active" not in runs.log(REFERENCE)  # really vLLM's own CPU_ATTN


@pytest.mark.parametrize("name", OURS)
def test_our_backend_is_used(runs, name):
    log = runs.log(name)
    impl = "CPAttentionImpl" if "dcp2" in name else "BaseAttentionImpl"
    assert f"cp_attention impl active: {impl}, ops CpuOps (C++ CPU kernels)" in log
    if "dcp2" in name:
        assert "dcp rank 0/2" in log and "dcp rank 1/2" in log
        backend = "a2a" if "a2a" in name else "ag_rs"  # vLLM's --dcp-comm-backend, honoured
        assert f"dcp_comm_backend {backend}" in log
    # with vLLM's reorder the orders agree; without it the gather/scatter path must have run
    assert ("row order differs from vLLM's batch order" in log) == ("noreorder" in name)


@pytest.mark.parametrize("name", OURS)
def test_tokens_identical(runs, name):
    assert tokens(runs.get(name)) == tokens(runs.get(REFERENCE))


@pytest.mark.parametrize("name", OURS)
def test_logprobs_close(runs, name):
    diff = max_logprob_diff(runs.get(REFERENCE), runs.get(name))
    print(f"max |logprob diff| {name} vs {REFERENCE}: {diff:.2e}")
    assert diff <= LOGPROB_TOL


def test_greedy_margins_dominate_differences(runs):
    """Identical tokens mean something only if no step was a near tie."""
    ref = runs.get(REFERENCE)
    margins = greedy_margins(ref)
    worst_diff = max(max_logprob_diff(ref, runs.get(name)) for name in OURS)
    print(f"min greedy margin {min(margins):.4f}, max logprob diff {worst_diff:.2e}")
    assert all(s["rank"] == 1 for r in ref["requests"] for s in r["steps"])
    assert min(margins) >= MIN_MARGIN
    assert min(margins) >= MARGIN_OVER_DIFF * worst_diff


def test_negative_control_broken_dcp_combine_changestokens(runs):
    """Dropping the DCP combine (each rank keeps only its KV shard) must be detected."""
    fault = runs.get("cp_tp2_dcp2_fault")
    assert "test fault skip_dcp_combine: DCP partials are NOT combined" in runs.log(
        "cp_tp2_dcp2_fault")
    ref = tokens(runs.get(REFERENCE))
    changed = [i for i, (a, b) in enumerate(zip(ref, tokens(fault))) if a != b]
    assert len(changed) >= 2, f"only requests {changed} changed under a broken DCP combine"
