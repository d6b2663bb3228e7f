"""End to end in a real vLLM (CPU): vLLM's CPU_ATTN vs cp_attention at tp=1 and tp=2 dcp=2
(combine `ag_rs` and `a2a`, vLLM's --dcp-comm-backend); PCP runs: test_e2e_pcp.py.

Each configuration runs in a fresh subprocess (``run_llm.py``) on a tiny Llama with random
weights (4 query heads, 1 KV head, head_dim 32), greedy fp32, block size 32, 4 prompts given
as token ids. Scheduling (max_num_seqs=3, 64 batched tokens, per-request max_tokens) makes the
run contain: a first step of three prefills (8, 37 and the first 19 tokens of 100); a chunked
prefill whose later chunks (63, then 18 tokens) attend cached (DCP-sharded) context next to
decodes; a one-token prompt; prompts crossing block boundaries. Request 0 ends after its
prefill, so vLLM moves the chunked prefill into batch slot 0 ahead of a decode: with
``CP_ATTENTION_VLLM_REORDER=0`` (vLLM keeps that order) our rows are a permutation of vLLM's
and the gather/scatter path runs; by default vLLM reorders decodes first and the orders agree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run_llm import RESULT_PREFIX  # sibling modules (tests/vllm_e2e is on sys.path)
from tiny_model import make_tiny_llama

pytestmark = pytest.mark.vllm

RUNNER = Path(__file__).with_name("run_llm.py")
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
RUN_TIMEOUT_S = 900  # a loaded 2-core box; quiet machine: < 60 s per run

CP = {"CP_ATTENTION_VLLM": "1"}
NO_REORDER = {"CP_ATTENTION_VLLM_REORDER": "0"}
TWO_RANKS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
DCP2 = ["--tp", "2", "--dcp", "2"]
RUNS = {
    "cpu_attn_tp1": ({}, []),
    "cp_tp1": (CP, []),
    "cp_tp1_noreorder": ({**CP, **NO_REORDER}, []),
    "cp_tp2_dcp2": ({**CP, **TWO_RANKS}, DCP2),
    "cp_tp2_dcp2_il16_noreorder": ({**CP, **TWO_RANKS, **NO_REORDER}, DCP2 + ["--interleave", "16"]),
    "cp_tp2_dcp2_a2a": ({**CP, **TWO_RANKS}, DCP2 + ["--dcp-comm-backend", "a2a"]),
    "cp_tp2_dcp2_fault": ({**CP, **TWO_RANKS, "CP_ATTENTION_VLLM_FAULT": "skip_dcp_combine"}, DCP2),
}
REFERENCE = "cpu_attn_tp1"
OURS = ["cp_tp1", "cp_tp1_noreorder", "cp_tp2_dcp2", "cp_tp2_dcp2_il16_noreorder", "cp_tp2_dcp2_a2a"]


class Runs:
    """Runs each configuration once (lazily) and keeps its parsed result and log."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model, self.workdir = model, workdir
        self.results: dict[str, dict] = {}
        self.logs: dict[str, str] = {}

    def get(self, name: str) -> dict:
        if name not in self.results:
            self._run(name)
        return self.results[name]

    def log(self, name: str) -> str:
        self.get(name)
        return self.logs[name]

    def _run(self, name: str) -> None:
        extra_env, args = RUNS[name]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CP_ATTENTION_VLLM", "VLLM_"))}
        # EngineCore in process: every request is queued before the first step, so the
        # schedule (and the batch orders tested here) is deterministic.
        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}, **extra_env)
        cmd = [sys.executable, str(RUNNER), str(self.model), "--block-size", "32",
               "--max-num-seqs", "3", "--max-batched", "64", "--logprobs", "2",
               "--max-tokens", json.dumps(MAX_TOKENS), "--prompts", json.dumps(PROMPTS), *args]
        start = time.time()
        proc = subprocess.run(cmd, env=env, cwd=self.workdir, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        log = proc.stdout + proc.stderr
        (self.workdir / f"{name}.log").write_text(log)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
        assert proc.returncode == 0 and lines, (
            f"{name} failed (rc {proc.returncode}); log tail:\n{log[-4000:]}")
        result = json.loads(lines[-1][len(RESULT_PREFIX):])
        result["wall_s"] = round(time.time() - start, 1)
        print(f"\n[vllm e2e] {name}: wall {result['wall_s']} s (init {result['init_s']} s, "
              f"generate {result['generate_s']} s)")
        self.results[name], self.logs[name] = result, log


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("vllm_e2e")
    return Runs(make_tiny_llama(root / "tiny_llama"), root)


def _tokens(result: dict) -> list[list[int]]:
    return [r["token_ids"] for r in result["requests"]]


def _max_logprob_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for ra, rb in zip(a["requests"], b["requests"], strict=True):
        for sa, sb in zip(ra["steps"], rb["steps"], strict=True):
            top_b = dict((t, lp) for t, lp in sb["top"])
            for token, lp in sa["top"]:
                assert token in top_b, f"top-2 token sets differ: {sa['top']} vs {sb['top']}"
                worst = max(worst, abs(lp - top_b[token]))
    return worst


def test_reference_generates_expected_lengths(runs):
    ref = runs.get(REFERENCE)
    assert [r["prompt_len"] for r in ref["requests"]] == [len(p) for p in PROMPTS]
    assert [len(t) for t in _tokens(ref)] == MAX_TOKENS
    assert "cp_attention impl active" not in runs.log(REFERENCE)  # really vLLM's own CPU_ATTN


@pytest.mark.parametrize("name", OURS)
def test_our_backend_is_used(runs, name):
    log = runs.log(name)
    impl = "CPAttentionImpl" if "dcp2" in name else "BaseAttentionImpl"
    assert f"cp_attention impl active: {impl}" in log
    if "dcp2" in name:
        assert "dcp rank 0/2" in log and "dcp rank 1/2" in log
        backend = "a2a" if "a2a" in name else "ag_rs"  # vLLM's --dcp-comm-backend, honoured
        assert f"dcp_comm_backend {backend}" in log
    # with vLLM's reorder the orders agree; without it the gather/scatter path must have run
    assert ("row order differs from vLLM's batch order" in log) == ("noreorder" in name)


@pytest.mark.parametrize("name", OURS)
def test_tokens_identical(runs, name):
    assert _tokens(runs.get(name)) == _tokens(runs.get(REFERENCE))


@pytest.mark.parametrize("name", OURS)
def test_logprobs_close(runs, name):
    diff = _max_logprob_diff(runs.get(REFERENCE), runs.get(name))
    print(f"max |logprob diff| {name} vs {REFERENCE}: {diff:.2e}")
    assert diff <= LOGPROB_TOL


def test_greedy_margins_dominate_differences(runs):
    """Identical tokens mean something only if no step was a near tie."""
    ref = runs.get(REFERENCE)
    margins = [s["top"][0][1] - s["top"][1][1] for r in ref["requests"] for s in r["steps"]]
    worst_diff = max(_max_logprob_diff(ref, runs.get(name)) for name in OURS)
    print(f"min greedy margin {min(margins):.4f}, max logprob diff {worst_diff:.2e}")
    assert all(s["rank"] == 1 for r in ref["requests"] for s in r["steps"])
    assert min(margins) >= MIN_MARGIN
    assert min(margins) >= MARGIN_OVER_DIFF * worst_diff


def test_negative_control_broken_dcp_combine_changes_tokens(runs):
    """Dropping the DCP combine (each rank keeps only its KV shard) must be detected."""
    fault = runs.get("cp_tp2_dcp2_fault")
    assert "skip_dcp_combine" in runs.log("cp_tp2_dcp2_fault")
    ref = _tokens(runs.get(REFERENCE))
    changed = [i for i, (a, b) in enumerate(zip(ref, _tokens(fault))) if a != b]
    assert len(changed) >= 2, f"only requests {changed} changed under a broken DCP combine"
