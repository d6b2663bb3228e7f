"""An engine subprocess of the vLLM benchmarks, driven line by line.

The engine (``python -m benchmarks.<bench> --engine ...``) prints a ready line once its model
is loaded, then answers each request line on stdin with one result line (a prefix and JSON).
Everything else it prints (vLLM logs to stdout and stderr) goes to its log file. It runs in
its own process group, so that closing it also ends the workers of vLLM's mp executor.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.common import REPO_ROOT


def engine_env(**settings: str) -> dict[str, str]:
    """This process's environment without any ``VLLM_*`` / ``CP_ATTENTION_VLLM*`` setting, plus
    one engine process per LLM (no V1 multiprocessing), a 1 GiB CPU KV cache, unbuffered
    output, the repository on ``PYTHONPATH``, and ``settings``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CP_ATTENTION_VLLM", "VLLM_"))}
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
                .rstrip(os.pathsep)})
    env.update(settings)
    return env


class EngineFailed(RuntimeError):
    """The engine ended, or timed out, before the line it was waited for; ``reason`` is the
    last error line of its log (the line after a pydantic header: vLLM's config refusals)."""

    def __init__(self, label: str, log: str) -> None:
        lines = log.splitlines()
        at = max((i for i, ln in enumerate(lines) if "Error:" in ln), default=None)
        if at is not None and "validation error" in lines[at] and at + 1 < len(lines):
            at += 1
        self.reason = lines[at].strip() if at is not None else log[-500:]
        super().__init__(f"{label}: engine failed: {self.reason}\nlog tail:\n{log[-3000:]}")


class EngineProcess:
    """One started engine: ``request(line)`` -> the JSON of its result line.

    Waits for the ``ready`` line (``start_timeout_s``); ``cpus``: the CPUs it may run on (its
    threads and worker processes inherit the affinity), all of this process's if None.
    Raises :class:`EngineFailed` where a line does not come.
    """

    def __init__(self, label: str, cmd: list[str], env: dict[str, str], log_path: Path, *,
                 ready: str, result: str, start_timeout_s: float, request_timeout_s: float,
                 cpus: list[int] | None = None) -> None:
        self.label, self.log_path = label, log_path
        self._result, self._request_timeout_s = result, request_timeout_s
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, start_new_session=True,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
        start = time.time()
        self._read_until(ready, start_timeout_s)
        self.startup_s = time.time() - start

    def request(self, line: str) -> dict:
        """Send one request line; the JSON of the engine's result line."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read_until(self._result, self._request_timeout_s)
                          [len(self._result):])

    def _read_until(self, prefix: str, timeout_s: float) -> str:
        deadline = time.time() + timeout_s
        for line in self.proc.stdout:  # blocking; bounded by the run's alarm (run_alarm)
            if line.startswith(prefix):
                return line
            self._log.write(line)
            if time.time() > deadline:
                break
        self.close()
        raise EngineFailed(self.label, self.log_path.read_text(errors="replace"))

    def close(self) -> None:
        """End the engine (stdin closed, then its whole process group killed)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # workers of the mp executor included
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def run_alarm(name: str, seconds: int) -> None:
    """A hard bound on a whole benchmark run (a hung engine must not hang it):
    ``TimeoutError`` after ``seconds``; ``signal.alarm(0)`` lifts it."""
    def _raise(signum, frame):
        raise TimeoutError(f"{name}: exceeded {seconds} s")
    signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
