"""The kernel ops' one fallback policy (``ops.interface.falls_back``): a call a kernel does not
take runs on pure torch, logged once per op and reason; an error under
``CP_ATTENTION_STRICT_OPS``."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from cp_attention import KernelFallbackError
from cp_attention.ops import CudaOps, NpuOps, get_ops, interface

STRICT = "CP_ATTENTION_STRICT_OPS"


# -- fallbacks: logged once per reason, an error under strict ---------------------------------
@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """No fallback logged yet in this process; returns a function giving the fallback records
    logged since."""
    monkeypatch.setattr(interface, "_FALLBACKS_LOGGED", set())
    monkeypatch.delenv(STRICT, raising=False)
    caplog.set_level(logging.WARNING, logger="cp_attention")
    return lambda: [r for r in caplog.records
                    if r.name == "cp_attention" and "falls back" in r.getMessage()]


def _paged(dtype, stride=1):
    """A small paged call: q [2, 2, 8]; caches [2, 4, 1, 8] with last-dim ``stride``."""
    gen = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(2, 4, 1, 8 * stride, generator=gen).to(dtype)[..., ::stride]
              for _ in range(2))
    q = torch.randn(2, 2, 8, generator=gen).to(dtype)
    return (q, kc, vc, torch.tensor([[0, 1]]), torch.tensor([0, 2]), torch.tensor([6]))


def test_cpu_fallback_logged_once_per_reason(cpu_ops, fresh_log):
    cpu_ops.paged_attention(*_paged(torch.float32), scale=0.5)  # the kernel: nothing logged
    assert fresh_log() == []
    for _ in range(2):
        out, _ = cpu_ops.paged_attention(*_paged(torch.float64), scale=0.5)
        assert out.dtype == torch.float64  # run by the reference ops
    assert [r.levelno for r in fresh_log()] == [logging.WARNING]
    message = fresh_log()[0].getMessage()
    assert "CpuOps.paged_attention" in message and "q dtype torch.float64" in message
    cpu_ops.paged_attention(*_paged(torch.float32, stride=2), scale=0.5)  # another reason
    cpu_ops.paged_attention(*_paged(torch.float32, stride=2), scale=0.5)
    assert len(fresh_log()) == 2
    assert "key_cache last-dim stride 2" in fresh_log()[1].getMessage()


def test_cpu_refusal_reasons(cpu_ops, fresh_log):
    """Each op names what its kernel does not take."""
    part = (torch.zeros(3, 2, 8, dtype=torch.bfloat16), torch.zeros(3, 2))
    cpu_ops.merge_attn_states(*part, *part)
    strided = torch.zeros(3, 2, 16)[..., ::2]
    cpu_ops.merge_attn_states(strided, part[1], strided, part[1])
    key = torch.zeros(1, 1, 8)
    q, kc, vc, *_ = _paged(torch.float32, stride=2)
    cpu_ops.reshape_and_cache(key, key, kc, vc, torch.tensor([3]))
    q64 = torch.zeros(2, 1, 8, dtype=torch.float64)
    cpu_ops.varlen_attention(q64, q64, q64, torch.tensor([0, 2]), torch.tensor([0, 2]),
                             scale=1.0, causal=True, window=1)
    expected = [("CpuOps.merge_attn_states", "out_a dtype torch.bfloat16"),
                ("CpuOps.merge_attn_states", "out_a last-dim stride 2"),
                ("CpuOps.reshape_and_cache", "key_cache last-dim stride 2"),
                ("CpuOps.varlen_attention", "q dtype torch.float64")]
    messages = [r.getMessage() for r in fresh_log()]
    assert len(messages) == len(expected)
    assert all(f"{op} falls back" in m and f": {why} (" in m
               for m, (op, why) in zip(messages, expected)), messages


def test_strict_ops_raise_instead(cpu_ops, fresh_log, monkeypatch):
    monkeypatch.setenv(STRICT, "1")
    with pytest.raises(KernelFallbackError,
                       match=r"CpuOps\.paged_attention: .*\(q dtype torch\.float64\)") as info:
        cpu_ops.paged_attention(*_paged(torch.float64), scale=0.5)
    assert isinstance(info.value, RuntimeError) and STRICT in str(info.value)
    with pytest.raises(KernelFallbackError, match=r"CpuOps\.cache_and_paged_attention"):
        q, kc, vc, table, cu, lens = _paged(torch.float32, stride=2)
        cpu_ops.cache_and_paged_attention(q, q[:, :1], q[:, :1], kc, vc, torch.tensor([0, 1]),
                                          table, cu, lens, scale=0.5)
    with pytest.raises(KernelFallbackError, match=r"NpuOps\.varlen_attention: .*float32"):
        q = torch.zeros(2, 1, 8)
        NpuOps().varlen_attention(q, q, q, torch.tensor([0, 2]), torch.tensor([0, 2]),
                                  scale=1.0, causal=True)
    assert fresh_log() == []
    cpu_ops.paged_attention(*_paged(torch.float32), scale=0.5)  # the kernels still run


def test_cuda_explicit_math_is_a_fallback_unless_asked_for(fresh_log, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable
    q = torch.zeros(2, 1, 8, dtype=torch.float16)
    args = (q, q, q, torch.tensor([0, 2]), torch.tensor([0, 2]))
    CudaOps(use_flash=False).varlen_attention(*args, scale=1.0, causal=True)
    assert fresh_log() == []
    CudaOps().varlen_attention(*args, scale=1.0, causal=True)
    CudaOps().varlen_attention(*args, scale=1.0, causal=True)
    assert len(fresh_log()) == 1 and "flash_attn not importable" in fresh_log()[0].getMessage()
    monkeypatch.setenv(STRICT, "1")
    CudaOps(use_flash=False).varlen_attention(*args, scale=1.0, causal=True)
    with pytest.raises(KernelFallbackError, match="CudaOps.varlen_attention"):
        CudaOps().varlen_attention(*args, scale=1.0, causal=True)


def test_failed_build_is_an_error_under_strict(monkeypatch, fresh_log):
    """The process-wide fallback: get_ops("cpu") without the kernels."""
    monkeypatch.setattr("cp_attention.ops.load_cpu_extension", lambda: None)
    assert get_ops("cpu").name == "reference"
    assert "the C++ CPU kernels did not build" in fresh_log()[0].getMessage()
    monkeypatch.setenv("CP_ATTENTION_OPS", "reference")  # asked for: no fallback, no error
    monkeypatch.setenv(STRICT, "1")
    assert get_ops("cpu").name == "reference"
    monkeypatch.delenv("CP_ATTENTION_OPS")
    with pytest.raises(KernelFallbackError, match="get_ops: .*did not build"):
        get_ops("cpu")
