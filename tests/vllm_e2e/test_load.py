"""Real traffic: vLLM's OpenAI server with cp_attention's PCP under a bounded concurrent load.

The real checkpoint of ``real_model.py`` (SmolLM2-135M-Instruct, 9 query / 3 KV heads, fp32) is
served with ``CP_ATTENTION_VLLM=1 --prefill-context-parallel-size 2
--decode-context-parallel-size 2`` (two workers, the KV of every request sharded over both,
chunked prefill, prefix caching on, the per-step token check on). ``loadgen`` sends 32 greedy
streaming completions with prompts of 20 to 4,000 tokens (log-uniform; a slice of a ship's log
and a question in the chat template, a bare slice below 50 tokens), 16 in flight; every 8th is
cancelled after two chunks; three invalid requests (a prompt over the model length, a negative
temperature, top_p > 1) are mixed in. Asserted: every valid request completes with all its
tokens and equals the offline run of vLLM's own CPU_ATTN at pcp=1 (a difference only at a
near-tie of the reference, after which the request is not compared further); cancelled ones
agree on what they received; invalid ones get HTTP 400 and the server keeps serving; after the
load ``/metrics`` shows no running or waiting request and KV cache usage 0; SIGTERM leaves no
process. The load's figures (requests/s, p50/p99 TTFT and TPOT) are printed; the same load
against vLLM's own server, for comparison, is a benchmark (``benchmarks/bench_vllm_load.py``).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from harness import RunSpec, Runs, greedy_margins, pcp_exchange_logged  # sibling modules
from loadgen import make_load, metric, run_load, summarize
from real_model import log_prompt_maker, prepare
from server import Server, group_alive

pytestmark = pytest.mark.vllm

SERVED_NAME = "smollm2-135m-instruct"
MAX_MODEL_LEN = 4160
NUM_VALID, MIN_LEN, MAX_LEN, MAX_TOKENS = 32, 20, 4000, 8
CONCURRENCY, CANCEL_EVERY = 16, 8
NEAR_TIE = 2e-3  # a greedy step whose top-1 and top-2 logprobs are closer may flip
INVALID = [
    {"prompt": [5] * (MAX_MODEL_LEN + 100)},  # longer than the model length
    {"temperature": -1.0},
    {"top_p": 1.5},
]
SCHEDULE = ["--block-size", "32", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024"]
COMMON = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
          "--enforce-eager", "--load-format", "safetensors", "--enable-prefix-caching",
          "--distributed-executor-backend", "mp", *SCHEDULE]
OURS = (["--prefill-context-parallel-size", "2", "--decode-context-parallel-size", "2"],
        {"CP_ATTENTION_VLLM": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
         "CP_ATTENTION_VLLM_CHECK_TOKENS": "1", "VLLM_LOGGING_LEVEL": "INFO"})
VLLM_OWN = ([], {})  # vLLM's own CPU_ATTN, one worker (benchmarks/bench_vllm_load.py)
REQUEST_TIMEOUT_S = 600
DRAIN_TIMEOUT_S = 60


def _serve_load(model: Path, root: Path, name: str, layout: tuple[list[str], dict],
                num_valid: int = NUM_VALID) -> dict:
    """Starts a server, sends the load, reads /metrics after it drains, stops the server."""
    load = make_load(num_valid, MIN_LEN, MAX_LEN, MAX_TOKENS, log_prompt_maker(model),
                     cancel_every=CANCEL_EVERY, invalid=[dict(b) for b in INVALID])
    args, env = layout
    server = Server(model, root / f"{name}.log", SERVED_NAME, [*COMMON, *args], env)
    try:
        startup_s = server.wait_healthy()
        outcomes, wall_s = run_load(server.base_url, SERVED_NAME, load, CONCURRENCY,
                                    REQUEST_TIMEOUT_S)
        after, _ = run_load(server.base_url, SERVED_NAME, load[:1], 1, REQUEST_TIMEOUT_S)
        deadline, page = time.time() + DRAIN_TIMEOUT_S, ""
        while time.time() < deadline:  # the engine frees aborted requests asynchronously
            page = server.get("/metrics")
            if (metric(page, "vllm:num_requests_running") == 0
                    and metric(page, "vllm:num_requests_waiting") == 0
                    and metric(page, "vllm:kv_cache_usage_perc") == 0):
                break
            time.sleep(1)
    finally:
        server.stop()
    figures = summarize(load, outcomes, wall_s)
    print(f"\n[load] {name}: healthy after {startup_s:.0f} s; {json.dumps(figures)}")
    return {"load": load, "outcomes": outcomes, "after": after[0], "metrics": page,
            "figures": figures, "server": server}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_load")
    model = prepare()
    ours = _serve_load(model, root, "cp_attention_pcp2", OURS)
    valid = [r for r in ours["load"] if r.invalid is None]
    (root / "prompts.json").write_text(json.dumps([r.prompt for r in valid]))
    common = ["--block-size", "32", "--max-num-seqs", "16", "--max-batched", "1024",
              "--max-model-len", str(MAX_MODEL_LEN), "--logprobs", "2",
              "--max-tokens", str(MAX_TOKENS), "--prompts", f"@{root / 'prompts.json'}"]
    runs = Runs({"default": model}, root, {"offline_cpu_attn": RunSpec()}, common)
    reference = runs.get("offline_cpu_attn")
    yield {"ours": ours, "reference": reference, "valid": valid}


def _outcomes(run: dict, which: str):
    return [(r, o) for r, o in zip(run["load"], run["outcomes"])
            if (r.invalid is None) == (which != "invalid")
            and (which == "invalid" or o.cancelled == (which == "cancelled"))]


def _first_difference(got: list[int], ref: dict) -> int | None:
    for step, (a, b) in enumerate(zip(got, ref["token_ids"])):
        if a != b:
            return step
    return None


def test_every_valid_request_completes(loaded):
    run = loaded["ours"]
    done = _outcomes(run, "completed")
    assert len(done) == NUM_VALID - NUM_VALID // CANCEL_EVERY
    for req, out in done:
        assert out.status is None, (req.index, out.error)
        assert len(out.token_ids) == MAX_TOKENS and out.finish_reason == "length", req.index
    cancelled = _outcomes(run, "cancelled")
    assert len(cancelled) == NUM_VALID // CANCEL_EVERY
    assert all(o.status is None and len(o.token_ids) >= 2 for _, o in cancelled)


def test_greedy_tokens_equal_offline_cpu_attn(loaded):
    """Completed and cancelled requests of our server vs vLLM's own offline run."""
    ref = {tuple(r.prompt): res for r, res in zip(loaded["valid"],
                                                   loaded["reference"]["requests"], strict=True)}
    flips = []
    for req, out in _outcomes(loaded["ours"], "completed") + _outcomes(loaded["ours"],
                                                                       "cancelled"):
        expected = ref[tuple(req.prompt)]
        step = _first_difference(out.token_ids, expected)
        if step is not None:
            top = expected["steps"][step]["top"]
            margin = top[0][1] - top[1][1]
            assert margin < NEAR_TIE, (f"request {req.index} ({len(req.prompt)} tokens) differs "
                                       f"at step {step} where the reference margin is {margin}")
            flips.append((req.index, step, margin))
    margins = greedy_margins(loaded["reference"])
    print(f"\n[load] near-tie flips {flips}; smallest reference margin {min(margins):.2e}")
    assert len(flips) <= 2, flips


def test_invalid_requests_get_400_and_serving_goes_on(loaded):
    run = loaded["ours"]
    bad = _outcomes(run, "invalid")
    assert len(bad) == len(INVALID)
    assert all(o.status == 400 for _, o in bad), [(o.status, o.error) for _, o in bad]
    assert len(run["after"].token_ids) == MAX_TOKENS  # a request after the load still completes


def test_nothing_running_and_kv_free_after_the_load(loaded):
    page = loaded["ours"]["metrics"]
    assert metric(page, "vllm:num_requests_running") == 0
    assert metric(page, "vllm:num_requests_waiting") == 0
    assert metric(page, "vllm:kv_cache_usage_perc") == 0


def test_our_server_ran_pcp_and_stopped_cleanly(loaded):
    server = loaded["ours"]["server"]
    log = server.log_path.read_text(errors="replace")
    for rank in (0, 1):
        assert f"cp_attention PCP model runner: pcp rank {rank}/2, token check on" in log
        assert re.search(rf"cp_attention impl active: .* heads 9/3 .*dcp rank {rank}/2, "
                         rf"pcp rank {rank}/2, kv_shard cp", log), log[-3000:]
    assert pcp_exchange_logged(log), log[-3000:]
    assert "PCPTokenMismatch" not in log
    assert server.stopped_cleanly and not group_alive(server.pgid)
