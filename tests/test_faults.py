"""Faults on long multi-rank runs: ranks that disagree on the step, die or stall, and cache
writes outside the step's slots. Nothing may hang; every failure names what went wrong.
"""
from __future__ import annotations

import queue
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_attention.config import CPConfig
from cp_attention.debug import step_checksum, step_field_checksums
from cp_attention.metadata.common import StepSpec
from cp_attention.testing.workload import Workload

from numerics_tasks import fault_worker, run_checked

CP4 = CPConfig(pcp_size=2, tp_size=2, dcp_size=2)  # world 4: PCP and DCP groups
STEPS = (((0, 37), (1, 9)), ((0, 1), (1, 1)), ((0, 2), (2, 20)), ((0, 1), (1, 1), (2, 1)))
COLLECTIVE_ERRORS = {"RuntimeError", "DistBackendError", "DistNetworkError", "DistStoreError"}


def workload(config: CPConfig, **kwargs) -> Workload:
    kwargs.setdefault("num_heads", 4)
    kwargs.setdefault("num_kv_heads", 1 if config.dcp_size > 1 else 2)
    return Workload(config, STEPS, head_size=16, **kwargs)


# -- step consistency -------------------------------------------------------------------------
def test_step_checksum_is_deterministic_and_sensitive() -> None:
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    step = StepSpec((0, 7), (5, 1), table)
    assert step_checksum(step) == step_checksum(StepSpec((0, 7), (5, 1), table.clone().long()))
    assert 0 <= step_checksum(step) < 2 ** 63
    others = [StepSpec((0, 8), (5, 1), table), StepSpec((0, 7), (6, 1), table),
              StepSpec((0, 7), (5, 1), table.flip(0)), StepSpec((0, 7), (5, 1), table[:, :1]),
              StepSpec((7, 0), (1, 5), table)]
    sums = {step_checksum(s) for s in others} | {step_checksum(step)}
    assert len(sums) == len(others) + 1
    assert step_field_checksums(others[0])[1:] == step_field_checksums(step)[1:]


@pytest.mark.distributed
@pytest.mark.parametrize("field", ["none", "num_computed_tokens", "num_scheduled_tokens",
                                   "block_table"])
def test_assert_step_consistent_names_the_odd_rank(pools, field: str) -> None:
    bad = None if field == "none" else 2
    results = pools(4).run("numerics_tasks.step_consistency_task", CP4, bad, field)
    if bad is None:
        assert [r[0] for r in results] == ["ok"] * 4
        assert len({r[2] for r in results}) == 1  # the checksum is the same in every process
        return
    for kind, message, _ in results:  # every rank sees the same gathered checksums
        assert kind == "StepMismatchError"
        assert "ranks [2] disagree with ranks [0, 1, 3]" in message
        assert f"differing fields: {field}" in message


# -- dead or stalled ranks --------------------------------------------------------------------
def run_fault(fault: str, timeout_s: float, world_config: CPConfig = CP4,
              bad_rank: int = 2, margin_s: float = 20.0, set_subgroup_timeout: bool = False
              ) -> dict[int, tuple]:
    """Spawn a gloo world where ``bad_rank`` dies/stalls; results of the survivors by rank."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    world = world_config.world_size
    # the rendezvous server lives here, on a port the OS assigned while it listens; the ranks
    # join it as clients (TORCHELASTIC_USE_AGENT_STORE, as under torchrun)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    port = store.port
    w = workload(world_config)
    procs = [ctx.Process(target=fault_worker, daemon=True,
                         args=(r, world, port, w, fault, bad_rank, timeout_s, set_subgroup_timeout,
                               outbox))
             for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + 60 + timeout_s + margin_s  # start-up of spawned ranks included
    try:
        while len(results) < world - 1 and time.monotonic() < deadline:
            try:
                rank, kind, message, seconds = outbox.get(timeout=1.0)
                results[rank] = (kind, message, seconds)
            except queue.Empty:
                pass
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    return results


FAULT_TIMEOUT_S = 4.0
MARGIN_S = 6.0


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["exit", "sleep"])
def test_survivors_fail_within_timeout(fault: str) -> None:
    results = run_fault(fault, FAULT_TIMEOUT_S)
    survivors = sorted(set(range(CP4.world_size)) - {2})
    assert sorted(results) == survivors, f"survivors that never reported: {results}"
    for rank, (kind, message, seconds) in results.items():
        assert kind != "ok", f"rank {rank} finished a forward without its peer"
        # the collective failed (torch.distributed's errors), not our code (ValueError,
        # AssertionError, StepMismatchError, ...) on the way to it
        assert kind in COLLECTIVE_ERRORS, (rank, kind, message)
        assert seconds < FAULT_TIMEOUT_S + MARGIN_S, (rank, seconds, message)
        # gloo names the failure: a timeout, or the peer's closed connection
        assert any(word in message.lower() for word in ("timed out", "timeout", "closed",
                                                        "connection", "reset", "peer")), message
    print(f"{fault}: time to fail per survivor "
          f"{ {r: round(v[2], 2) for r, v in results.items()} } s")


# -- no write outside the step's slots --------------------------------------------------------
@pytest.mark.parametrize("config", [CPConfig(), CPConfig(block_size=32, cp_kv_interleave_size=4)],
                         ids=["default", "bs32"])
def test_single_device_writes_only_step_slots(config: CPConfig) -> None:
    result = run_checked(workload(config, num_kv_heads=2))
    assert result["untouched_ok"], f"blocks changed outside the step: {result['changed_blocks']}"
    assert result["max_err"] < 1e-5 and not result["any_nan"]


@pytest.mark.distributed
@pytest.mark.parametrize("config", [CP4, CPConfig(pcp_size=2, tp_size=2, dcp_size=2,
                                                  kv_shard="dcp", cp_kv_interleave_size=4)],
                         ids=["cp", "dcp_interleave4"])
def test_cp_writes_only_step_slots(pools, config: CPConfig) -> None:
    results = pools(4).run("numerics_tasks.run_checked_task", workload(config))
    for rank, result in enumerate(results):
        assert result["untouched_ok"], (rank, result["changed_blocks"])
        assert result["max_err"] < 1e-5 and not result["any_nan"], (rank, result["max_err"])
