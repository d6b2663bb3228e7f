"""tests/vllm_e2e run only where vLLM is importable (the vLLM venv, see .ci/run_vllm).

Elsewhere every test here is skipped cleanly. With ``CP_ATTENTION_REQUIRE_VLLM=1`` (set by
.ci/run_vllm) a missing vLLM is an error and any skipped test fails the session, so a skip can
never pass for a run.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from cp_attention import envs

HERE = os.path.dirname(os.path.abspath(__file__))
REQUIRED = envs.CP_ATTENTION_REQUIRE_VLLM
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
_skipped: list[str] = []


def pytest_configure(config) -> None:
    if REQUIRED and not HAVE_VLLM:
        raise pytest.UsageError("CP_ATTENTION_REQUIRE_VLLM=1 but vllm is not importable")


def pytest_collection_modifyitems(config, items) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm is not installed (run .ci/run_vllm)")
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(skip)


def pytest_runtest_logreport(report) -> None:
    if report.skipped and "vllm_e2e/" in report.nodeid.replace("\\", "/"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus) -> None:
    if REQUIRED and _skipped and exitstatus == 0:
        print(f"\nCP_ATTENTION_REQUIRE_VLLM=1: {len(_skipped)} vLLM test(s) skipped: {_skipped}")
        session.exitstatus = 1
