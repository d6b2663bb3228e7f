"""Device choice of the launchers (every branch of the pure choose_device, the probe here) and
the workload runner with a device's ops class."""
from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import npu_emulator
from cp_attention.config import CPConfig
from cp_attention.launch.device import (DeviceUnavailableError, choose_device,
                                        probe_device_counts, select_device)
from cp_attention.ops import get_ops
from cp_attention.ops.cuda import CudaOps
from cp_attention.ops.npu import NpuOps
from cp_attention.testing.workload import Workload, run_workload


def choose(requested, cuda=0, npu=0, local_rank=0, local_world_size=1):
    return choose_device(requested, cuda_count=cuda, npu_count=npu, local_rank=local_rank,
                         local_world_size=local_world_size)


@pytest.mark.parametrize("cuda,npu", [(0, 0), (8, 0), (0, 8), (8, 8)])
def test_cpu_forced_ignores_accelerators(cuda, npu):
    choice = choose("cpu", cuda, npu, local_rank=3, local_world_size=4)
    assert (choice.type, choice.index, choice.note) == ("cpu", None, None)
    assert choice.device == torch.device("cpu") and str(choice) == "cpu"


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_forced_accelerator_gets_local_rank_index(kind):
    counts = {"cuda": 0, "npu": 0, kind: 4}
    for local_rank in range(4):
        choice = choose(kind, counts["cuda"], counts["npu"], local_rank, 4)
        assert (choice.type, choice.index, choice.note) == (kind, local_rank, None)
        assert str(choice) == f"{kind}:{local_rank}"


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_forced_accelerator_missing_is_an_error(kind):
    other = {"cuda": "npu", "npu": "cuda"}[kind]
    counts = {kind: 0, other: 8}  # the other kind being present does not help
    with pytest.raises(DeviceUnavailableError, match=f"--device {kind}: no {kind.upper()}"):
        choose(kind, counts["cuda"], counts["npu"])


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_forced_accelerator_too_few_for_the_node_is_an_error(kind):
    counts = {"cuda": 0, "npu": 0, kind: 2}
    with pytest.raises(DeviceUnavailableError, match="4 ranks on this node but 2"):
        choose(kind, counts["cuda"], counts["npu"], local_rank=0, local_world_size=4)


def test_auto_prefers_npu_then_cuda_then_cpu():
    assert str(choose("auto", cuda=2, npu=2, local_rank=1, local_world_size=2)) == "npu:1"
    cuda = choose("auto", cuda=2, npu=0, local_rank=1, local_world_size=2)
    assert cuda.device == torch.device("cuda", 1)
    plain = choose("auto")
    assert plain.device == torch.device("cpu") and plain.note is None


def test_auto_skips_an_accelerator_with_too_few_devices():
    # 1 NPU for 4 ranks is not enough, 4 GPUs are: CUDA wins over the preferred NPU.
    assert str(choose("auto", cuda=4, npu=1, local_rank=2, local_world_size=4)) == "cuda:2"
    fallback = choose("auto", cuda=1, npu=0, local_rank=0, local_world_size=4)
    assert fallback.device == torch.device("cpu")
    assert fallback.note is not None and "1 CUDA device(s) for 4 ranks" in fallback.note


@pytest.mark.parametrize("requested", ["gpu", "CUDA", "", "cuda:0"])
def test_unknown_request_is_rejected(requested):
    with pytest.raises(ValueError, match="device must be one of"):
        choose(requested)


@pytest.mark.parametrize("local_rank,local_world_size", [(-1, 2), (2, 2), (0, 0)])
def test_bad_local_rank_is_rejected(local_rank, local_world_size):
    with pytest.raises(ValueError, match="local_rank"):
        choose("cpu", local_rank=local_rank, local_world_size=local_world_size)


@settings(max_examples=200, deadline=None)
@given(requested=st.sampled_from(["auto", "cpu", "cuda", "npu"]), cuda=st.integers(0, 9),
       npu=st.integers(0, 9), data=st.data())
def test_choice_invariants(requested, cuda, npu, data):
    """Whatever the host: an accelerator index is the local rank and exists; auto never fails."""
    local_world_size = data.draw(st.integers(1, 9))
    local_rank = data.draw(st.integers(0, local_world_size - 1))
    counts = {"cuda": cuda, "npu": npu, "cpu": 0}
    try:
        choice = choose(requested, cuda, npu, local_rank, local_world_size)
    except DeviceUnavailableError:
        assert requested in ("cuda", "npu") and counts[requested] < local_world_size
        return
    if requested != "auto":
        assert choice.type == requested
    if choice.type == "cpu":
        assert choice.index is None
        assert requested == "cpu" or (npu < local_world_size and cuda < local_world_size)
    else:
        assert choice.index == local_rank < counts[choice.type]


def test_probe_and_select_on_this_host(monkeypatch):
    """This host's truth: forced CPU always works; a forced accelerator torch cannot see fails
    with DeviceUnavailableError before any group is made; ``auto`` never imports torch_npu."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert select_device("cpu").device == torch.device("cpu")
    cuda, npu = probe_device_counts("auto")
    assert cuda == torch.cuda.device_count()
    assert "torch_npu" not in sys.modules or hasattr(torch, "npu")
    auto = select_device("auto")
    if cuda == 0 and npu == 0:
        assert auto.device == torch.device("cpu")
        with pytest.raises(DeviceUnavailableError, match="--device cuda"):
            select_device("cuda")
    else:
        assert auto.type in ("cuda", "npu") and auto.index == 0


def test_forced_npu_without_torch_npu_says_so(monkeypatch):
    """--device npu imports torch_npu; where it is missing the error names it (no crash)."""
    if hasattr(torch, "npu"):
        pytest.skip("torch_npu is loaded on this host")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    with pytest.raises(DeviceUnavailableError, match="needs torch_npu"):
        probe_device_counts("npu")


# ------------------------------------------------- the runner uses the device's ops it is given

MIXED = (((0, 70), (1, 1), (2, 33)), ((0, 1), (1, 1), (2, 1)), ((1, 40),),
         ((0, 1), (2, 1), (3, 50)), ((0, 1), (1, 1), (3, 23)))


def test_runner_reports_the_default_ops_of_its_device():
    report = run_workload(Workload(CPConfig(), MIXED, num_heads=4, num_kv_heads=2), device="cpu")
    assert (report.ops, report.device, report.backend) == (type(get_ops("cpu")).__name__, "cpu",
                                                           None)
    assert len(report.seconds_per_step) == len(MIXED)
    assert 0 < report.max_err <= 1e-4 and report.cache_exact


@pytest.mark.parametrize("kind", ["npu", "cuda"])
def test_runner_runs_a_device_ops_class_end_to_end(monkeypatch, kind):
    """The layer through NpuOps (over the torch_npu emulator) or CudaOps (explicit path) on CPU
    tensors, every row against the float64 oracle: what run_cp/cp-attn do on a device."""
    if kind == "npu":
        emulator = npu_emulator.install(monkeypatch, strict=False)
        ops = NpuOps(kernel_dtypes=None)  # every dtype to the (emulated) kernels
    else:
        emulator, ops = None, CudaOps()
    report = run_workload(Workload(CPConfig(), MIXED, num_heads=4, num_kv_heads=2), ops=ops)
    assert report.ops == type(ops).__name__
    assert 0 < report.max_err <= 1e-4 and report.cache_exact and not report.any_nan
    if emulator is not None:  # the fused attention, cache write and merge kernels all ran
        kernels = {call[0] for call in emulator.calls}
        assert {"fia", "reshape_and_cache", "attention_update"} <= kernels, kernels
