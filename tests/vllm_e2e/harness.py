"""Shared e2e plumbing: run ``run_llm.py`` in a fresh subprocess per configuration, keep the
parsed result and log, and compare runs (tokens, logprobs, greedy margins)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from run_llm import RESULT_PREFIX  # sibling module (tests/vllm_e2e is on sys.path)

RUNNER = Path(__file__).with_name("run_llm.py")
FAULTS_DIR = Path(__file__).with_name("faults")  # sitecustomize.py: test-only fault injection
RUN_TIMEOUT_S = 900  # a loaded 2-core box; quiet machine: < 60 s per run
CP = {"CP_ATTENTION_VLLM": "1"}
MULTI_WORKER = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@dataclass(frozen=True)
class RunSpec:
    """One configuration: environment, extra CLI args, model key; ``fails``: expected rc != 0;
    ``fault``: a negative control of ``faults/sitecustomize.py`` injected in every process."""

    env: dict = field(default_factory=dict)
    args: tuple = ()
    model: str = "default"
    fails: bool = False
    fault: str | None = None


class Runs:
    """Runs each configuration once (lazily) and keeps its parsed result(s) and log.

    A run with ``--dtype float32,bfloat16`` prints one result per dtype (``--num-gpu-blocks
    none,N``: per block budget too); ``get(name, label)`` picks one by its label, the dtype or
    ``"DTYPE/N blocks"`` (without ``label``: the first, the run's main dtype).
    """

    def __init__(self, models: dict[str, Path], workdir: Path, specs: dict[str, RunSpec],
                 common_args: list[str]) -> None:
        self.models, self.workdir, self.specs = models, workdir, specs
        self.common_args = common_args
        self.results: dict[str, dict[str | None, dict]] = {}
        self.logs: dict[str, str] = {}
        self.returncodes: dict[str, int] = {}

    def get(self, name: str, label: str | None = None) -> dict:
        if name not in self.logs:
            self._run(name)
        return self.results[name][label]

    def log(self, name: str) -> str:
        if name not in self.logs:
            self._run(name)
        return self.logs[name]

    def _run(self, name: str) -> None:
        spec = self.specs[name]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CP_ATTENTION_VLLM", "VLLM_", "CP_E2E_FAULT"))}
        # EngineCore in process: every request is queued before the first step, so the
        # schedule (and the batch orders tested) is deterministic.
        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}, **spec.env)
        if spec.fault is not None:
            env["CP_E2E_FAULT"] = spec.fault
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS_DIR),
                                                            env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, str(RUNNER), str(self.models[spec.model]), *self.common_args,
               *spec.args]
        start = time.time()
        proc = subprocess.run(cmd, env=env, cwd=self.workdir, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        log = proc.stdout + proc.stderr
        (self.workdir / f"{name}.log").write_text(log)
        self.logs[name], self.returncodes[name] = log, proc.returncode
        if spec.fails:
            assert proc.returncode != 0, f"{name} was expected to fail but exited 0"
            self.results[name] = {None: {}}
            return
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
        assert proc.returncode == 0 and lines, (
            f"{name} failed (rc {proc.returncode}); log tail:\n{log[-4000:]}")
        parsed = [json.loads(ln[len(RESULT_PREFIX):]) for ln in lines]
        wall = round(time.time() - start, 1)
        print(f"\n[vllm e2e] {name}: wall {wall} s (" + ", ".join(
            f"{r['label']}: init {r['init_s']} s, generate {r['generate_s']} s" for r in parsed)
            + ")")
        self.results[name] = {None: parsed[0], **{r["label"]: r for r in parsed}}


def pcp_exchange_logged(log: str, nodes: int = 1) -> bool:
    """Whether an engine log names the PCP exchange this CPU gets: on one node, vLLM CPU's
    shared memory (segment ``<ident>-cp_attention-pcp-[ranks]-cpushm``), whose ops only
    vLLM's AVX-512 builds have; an AVX2-only CPU loads ``_C_AVX2``, without
    ``shm_all_gather`` (``vllm/platforms/cpu.py`` ``import_kernels``), and the exchange runs
    on gloo. Ranks on ``nodes`` > 1 vLLM nodes share no segment: gloo, for the reason this CPU
    meets first."""
    if not torch.cpu._is_avx512_supported():
        return "cp_attention: the PCP exchange runs on gloo (no vLLM CPU shared memory ops)" in log
    if nodes > 1:
        return (f"cp_attention: the PCP exchange runs on gloo (its ranks are on {nodes} vLLM "
                "nodes") in log
    return re.search(r"cp_attention: PCP all-gather in shared memory \(\S+-cp_attention-"
                     r"pcp-\[\d+-\d+\]-cpushm\)", log) is not None


def tokens(result: dict) -> list[list[int]]:
    return [r["token_ids"] for r in result["requests"]]


def max_logprob_diff(a: dict, b: dict) -> float:
    """Largest |logprob| difference over the returned top-k tokens of every step."""
    worst = 0.0
    for ra, rb in zip(a["requests"], b["requests"], strict=True):
        for sa, sb in zip(ra["steps"], rb["steps"], strict=True):
            top_b = dict((t, lp) for t, lp in sb["top"])
            for token, lp in sa["top"]:
                assert token in top_b, f"top-k token sets differ: {sa['top']} vs {sb['top']}"
                worst = max(worst, abs(lp - top_b[token]))
    return worst


def greedy_margins(result: dict) -> list[float]:
    """Top-1 minus top-2 logprob of every generated step."""
    return [s["top"][0][1] - s["top"][1][1] for r in result["requests"] for s in r["steps"]]


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any vLLM / plugin switch, plus a small KV cache and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CP_ATTENTION_VLLM", "VLLM_"))}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessGroup:
    """``cmd`` started in its own session, so its process group holds every process it starts
    (vLLM's EngineCore and workers); stdout and stderr go to ``log_path``."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.pgid = self.proc.pid

    def alive(self) -> bool:
        """Whether any process of the group is left (the leader is reaped first)."""
        self.proc.poll()
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_gone(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the whole group to exit; True if it did."""
        deadline = time.time() + timeout_s
        while self.alive() and time.time() < deadline:
            time.sleep(0.5)
        return not self.alive()

    def stop(self, timeout_s: float = 60.0) -> bool:
        """SIGTERM to the group, SIGKILL to what is left after ``timeout_s``; True if the group
        exited on SIGTERM (or had already exited). Idempotent."""
        if self.alive():
            os.killpg(self.pgid, signal.SIGTERM)
        clean = self.wait_gone(timeout_s)
        if not clean:
            os.killpg(self.pgid, signal.SIGKILL)
            self.wait_gone(10)
        self.proc.wait(timeout=10)
        self._log.close()
        return clean
