"""Shared fixtures: gloo rank pools (spawned once per test session and size).

The suite runs with ``CP_ATTENTION_DEBUG=1``: every impl it builds (in this process and in
the spawned ranks, which inherit the environment) also runs the O(n) value checks.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

from cp_attention.ops import CpuOps, get_ops
from cp_attention.ops.cpu_build import forced_reference, load_cpu_extension
from cp_attention.testing.pool import RankPool

os.environ["CP_ATTENTION_DEBUG"] = "1"
_POOLS: dict[int, RankPool] = {}

# The vLLM tier runs in its own venv (.ci/run_vllm); without vLLM it is not collected at all.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_e2e"]


def rank_pool(world_size: int) -> RankPool:
    """A live pool of ``world_size`` gloo ranks, shared by every test of the session."""
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size]


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` returns the session's pool of n gloo ranks."""
    return rank_pool


@pytest.fixture(scope="session")
def cpu_ops() -> CpuOps:
    """``get_ops("cpu")`` backed by the built C++ kernels (paged and varlen): a failed build is
    a test failure here, not the fallback; skipped only under ``CP_ATTENTION_OPS=reference``."""
    if forced_reference():
        pytest.skip("CP_ATTENTION_OPS=reference: the C++ kernels are switched off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extension = load_cpu_extension()
    assert extension is not None and hasattr(extension, "varlen_attention")
    ops = get_ops("cpu")
    assert isinstance(ops, CpuOps)
    return ops
