"""The launchers end to end on this host's CPU: torchrun + launch/run_cp.py, the cp-attn demo
and launch/gpu_check.py, in real processes, checked on what they report (ops, device, backend,
error vs the float64 oracle, KV bytes)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cp_attention.launch.device import choose_device
from cp_attention.ops import get_ops

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
CPU_OPS = type(get_ops("cpu")).__name__
# What --device auto gives 2 local ranks here (the CPU on a host without 2 GPUs/NPUs).
AUTO_2 = choose_device("auto", cuda_count=torch.cuda.device_count(), npu_count=0, local_rank=0,
                       local_world_size=2).type


def free_port() -> int:
    """A port free now, for two agents that must agree on one before either binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun(tmp_path: Path, name: str, *flags: str) -> tuple[subprocess.Popen, Path]:
    """Start ``torchrun --nproc-per-node 2 launch/run_cp.py ... --json`` (not waited for)."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone",  # the agent binds a free port itself
           str(ROOT / "launch" / "run_cp.py"), "--prompt", "300", "--requests", "2",
           "--decode-steps", "2", "--check", "--no-progress", "--json", str(out), *flags]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True), out


def test_torchrun_run_cp_cpu_and_auto(tmp_path):
    """Two torchrun jobs (run concurrently): pcp=2 forced on the CPU, tp=2/dcp=2 on auto."""
    jobs = {"cpu": torchrun(tmp_path, "cpu", "--pcp", "2", "--device", "cpu"),
            "auto": torchrun(tmp_path, "auto", "--tp", "2", "--dcp", "2", "--device", "auto")}
    for name, (proc, out) in jobs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}:\n{log}"
        report = json.loads(out.read_text())
        device = "cpu" if name == "cpu" else AUTO_2
        ops = CPU_OPS if device == "cpu" else "CudaOps"
        backend = {"cpu": "gloo", "cuda": "nccl"}[device]
        assert report["ran"] == [dict(ops=ops, device=device, backend=backend)]
        assert f"ran: {ops} on {device} over {backend}" in log
        assert "PASS: float64 oracle" in log
        ranks = report["reports"]
        assert [r["device"].split(":")[0] for r in ranks] == [device, device]
        assert all(r["cache_exact"] and not r["any_nan"] for r in ranks)
        # a real float32 computation: small but not zero error against float64
        assert all(0 < r["max_err"] <= 1e-4 for r in ranks), [r["max_err"] for r in ranks]
        # 3 steps (prefill of 300 + 150 tokens, 2 decodes of both) checked on every rank
        assert all(len(r["max_err_per_step"]) == 3 and len(r["seconds_per_step"]) == 3
                   for r in ranks)
        rows = [sum(r["rows_per_step"]) for r in ranks]
        if name == "cpu":  # pcp=2: each rank computes half of the tokens (+ its padding)
            assert all(225 + 2 <= n <= 225 + 2 + 4 for n in rows), rows
        else:  # tp=2: both ranks compute every token for their heads
            assert rows == [454, 454]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session``), if alive."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


TWO_NODE_JOB = ["--pcp", "2", "--tp", "2", "--dcp", "2", "--prompt", "300", "--decode-steps", "2",
                "--check", "--no-progress", "--timeout", "60"]


def run_agents(tmp_path: Path, name: str, launches: list[list[str]]) -> list[str]:
    """One torchrun agent per entry of ``launches`` (its torchrun flags), all running
    ``run_cp.py TWO_NODE_JOB --json <name>.json``; each in its own process group, killed if
    still alive after 180 s (a hang fails instead of blocking). Returns the agents' logs."""
    out = tmp_path / f"{name}.json"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *flags, str(ROOT / "launch" / "run_cp.py"),
         *TWO_NODE_JOB, "--json", str(out)], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True) for flags in launches]
    logs = []
    try:
        for proc in agents:
            logs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in agents:
            kill_group(proc)
    for i, (proc, log) in enumerate(zip(agents, logs)):
        assert proc.returncode == 0, f"{name} agent {i}:\n{log}"
    return logs


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_torchrun_two_agents_pcp_across_nodes(tmp_path, rendezvous):
    """Two torchrun agents on 127.0.0.1 (one per "node", 2 ranks each) form one world of
    pcp=2 x tp=2 (dcp=2): PCP spans the nodes, TP/DCP stays inside each. The oracle check
    passes on every rank, the ranks report two nodes, and every rank's rows, KV bytes and
    errors equal those of the same job as 4 ranks on one node. c10d assigns the node ranks
    itself (``--node-rank`` is ignored there); static uses --node-rank and the master's port."""
    port = free_port()
    if rendezvous == "c10d":
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", f"cp-test-{port}", "--rdzv-conf", "join_timeout=60"]
    else:
        rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    logs = run_agents(tmp_path, "two", [["--nnodes", "2", "--node-rank", str(node),
                                         "--nproc-per-node", "2", *rdzv] for node in (0, 1)])
    log = next(log for log in logs if "run_cp: pcp=2 tp=2 dcp=2" in log)  # the rank-0 agent
    assert "world=4 device=cpu backend=gloo" in log
    assert "PASS: float64 oracle" in log
    assert "nodes: 2 (node 0: ranks [0, 1]; node 1: ranks [2, 3])" in log
    ranks = json.loads((tmp_path / "two.json").read_text())["reports"]
    assert [r["node"] for r in ranks] == [0, 0, 1, 1]
    assert all(r["cache_exact"] and not r["any_nan"] and 0 < r["max_err"] <= 1e-4 for r in ranks)

    (one_log,) = run_agents(tmp_path, "one", [["--nproc-per-node", "4", "--standalone"]])
    assert "nodes: 1 (node 0: ranks [0, 1, 2, 3])" in one_log
    one = json.loads((tmp_path / "one.json").read_text())["reports"]
    same = ("rows_per_step", "cache_bytes", "comm_bytes", "max_err_per_step")
    assert [{k: r[k] for k in same} for r in ranks] == [{k: r[k] for k in same} for r in one]


def run_cp_alone(*flags: str) -> subprocess.CompletedProcess:
    """``python launch/run_cp.py`` without torchrun (world 1)."""
    return subprocess.run([sys.executable, str(ROOT / "launch" / "run_cp.py"), "--prompt", "64",
                           "--decode-steps", "1", "--no-progress", *flags], env=env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_run_cp_forced_cuda_without_gpu_fails_clearly():
    result = run_cp_alone("--device", "cuda")
    assert result.returncode != 0
    assert "run_cp: --device cuda: no CUDA device is visible" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_reports_ops_memory_speedup_and_error(tmp_path):
    out = tmp_path / "demo.json"
    result = subprocess.run([sys.executable, "-m", "cp_attention.launch.demo", "--pcp", "2",
                             "--tp", "1", "--dcp", "1", "--prompt", "256", "--device", "cpu",
                             "--json", str(out)], env=env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["device"] == "cpu" and report["processes"] == 2
    assert report["ran"] == [dict(ops=CPU_OPS, device="cpu", backend="gloo")]
    assert f"ran: {CPU_OPS} on cpu over gloo" in result.stdout
    assert 0 < report["worst_err"] <= report["tolerance"] == 1e-4
    # KV memory: the demo's requests end at 256+7, 128+7, 7+1+64+4 and 128+128+4 tokens;
    # 16-token blocks, 2 spare; 1 KV head x 64 x fp32 x (K, V). One device holds every block,
    # a pcp=2 rank the blocks of half of each request.
    final = [263, 135, 76, 260]
    per_block = 2 * 16 * 1 * 64 * 4
    one = (sum(math.ceil(n / 16) for n in final) + 2) * per_block
    rank = (sum(math.ceil(n / 32) for n in final) + 2) * per_block
    assert report["kv_bytes_one_device"] == one
    assert report["kv_bytes_per_rank"] == rank
    assert [r["cache_bytes"] for r in report["ranks"]] == [rank, rank]
    assert f"{one / rank:.1f}x less per rank" in result.stdout
    # prefill: the slowest rank's time of step 0, against a single rank's time of that step
    assert report["prefill_tokens"] == 256 + 128 + 7
    assert report["prefill_s_cp"] == max(r["prefill_s"] for r in report["ranks"]) > 0
    assert report["prefill_s_one_rank"] > 0 and report["prefill_speedup"] > 0
    assert f"{report['prefill_speedup']:.2f}x speedup (2 processes on" in result.stdout


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "launch" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_gpu_check_runs_on_cpu_tensors_and_says_so(tmp_path, capsys):
    gpu_check = load_gpu_check()
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "every check ran on CPU tensors" in capsys.readouterr().out
    assert report["ran"] and report["all_ok"] and report["device"] == "cpu"
    assert "not exercised" in report["note"]
    assert len(report["contract"]) == 22 and all(r["ok"] for r in report["contract"])
    layer = report["layer"]
    assert (layer["ops"], layer["device"], layer["cache_exact"]) == ("CudaOps", "cpu", True)
    assert 0 < layer["max_err"] <= 1e-4
    cp = report["cp"]
    assert cp["ran"] and [(r["ops"], r["device"], r["backend"]) for r in cp["ranks"]] == \
        [(CPU_OPS, "cpu", "gloo")] * 2
    assert all(0 < r["max_err"] <= 1e-4 for r in cp["ranks"])
    assert report["timing"]["overhead_ratio"] > 0

    forced = tmp_path / "forced.json"
    assert gpu_check.main(["--out", str(forced), "--device", "cuda"]) == 2
    assert json.loads(forced.read_text()) == dict(
        ran=False, reason="--device cuda: no CUDA device is visible to this process")
