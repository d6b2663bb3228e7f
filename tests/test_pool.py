"""RankPool: a rank that dies fails the call at once (not after the timeout), naming it."""
from __future__ import annotations

import os
import time

import pytest

from cp_attention.testing.pool import RankPool

pytestmark = pytest.mark.distributed


def exit_on_rank_one_task(rank: int, get_groups, code: int) -> str:
    """Rank 1 dies without reporting; rank 0 reports its device."""
    if rank == 1:
        os._exit(code)
    return str(get_groups.device)


def device_task(rank: int, get_groups) -> str:
    return str(get_groups.device)


def test_dead_rank_fails_fast_and_pool_restarts():
    with RankPool(2, collective_timeout_s=30) as pool:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[1\] exited \(exit codes \{1: 7\}\)"):
            pool.run("test_pool.exit_on_rank_one_task", 7, timeout_s=120)
        assert time.monotonic() - start < 60  # detected by polling, not by the 120 s timeout
        # the next call restarts the ranks (on the pool's device, the CPU by default)
        assert pool.run("test_pool.device_task", timeout_s=120) == ["cpu", "cpu"]
