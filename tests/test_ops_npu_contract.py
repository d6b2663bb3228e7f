"""Contract tests of NpuOps: pure argument preparation, and end-to-end against ReferenceOps.

By default the kernels are the CPU emulator in ``tests/npu_emulator.py`` (documented torch_npu
semantics, explicit float64 math). With ``CP_ATTN_REAL_NPU=1`` the same end-to-end tests run
against the real ``torch_npu`` on an ``npu`` device (see docs/devices.md).
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_attention.ops import npu_args, paged_plan
from cp_attention.ops.interface import Mask
from cp_attention.ops.npu import NpuOps
from cp_attention.ops.reference import ReferenceOps

sys.path.insert(0, os.path.dirname(__file__))
import npu_emulator  # noqa: E402

REAL_NPU = os.environ.get("CP_ATTN_REAL_NPU") == "1"
HYP = settings(max_examples=20 if not REAL_NPU else 8, deadline=None, derandomize=True,
               database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass
class Backend:
    ops: NpuOps
    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    head_dim: int
    emulator: object | None


@pytest.fixture
def backend(monkeypatch) -> Backend:
    """NpuOps over the emulator (float64 exact + bf16 strict), or over real torch_npu."""
    if REAL_NPU:
        importlib.import_module("torch_npu")
        return Backend(NpuOps(), torch.device("npu"), (torch.float16, torch.bfloat16), 128, None)
    emu = npu_emulator.install(monkeypatch, strict=False)
    return Backend(NpuOps(kernel_dtypes=None), torch.device("cpu"), (torch.float64,), 16, emu)


def _tols(dtype: torch.dtype) -> dict:
    if dtype == torch.float64:
        return dict(rtol=1e-9, atol=1e-9)
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=2e-2, atol=2e-2)


def _lse_tols(dtype: torch.dtype) -> dict:
    if dtype == torch.float64:
        return dict(rtol=1e-9, atol=1e-9)
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=1e-3, atol=1e-3)


def _assert_matches(out, lse, ref_out, ref_lse, dtype):
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "empty rows differ"
    assert not torch.isnan(lse).any() and not torch.isnan(out).any()
    torch.testing.assert_close(out, ref_out, **_tols(dtype))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], **_lse_tols(dtype))


# ---------------------------------------------------------------- pure argument preparation

def test_cumulative_lengths_exact():
    assert npu_args.cumulative_lengths(torch.tensor([0, 3, 3, 7])) == [3, 3, 7]
    with pytest.raises(ValueError):
        npu_args.cumulative_lengths(torch.tensor([1, 3]))


def test_sparse_args_exact():
    assert npu_args.sparse_args(Mask(False)) == (0, npu_args.MAX_TOKENS, npu_args.MAX_TOKENS)
    assert npu_args.sparse_args(Mask(True)) == (3, npu_args.MAX_TOKENS, 0)
    assert npu_args.sparse_args(Mask(True, 5)) == (4, 4, 0)
    assert npu_args.band_tokens(Mask(True, 1)) == (0, 0)
    with pytest.raises(ValueError):
        npu_args.sparse_args(Mask(False, 4))
    assert npu_args.needs_compressed_mask(3) and npu_args.needs_compressed_mask(4)
    assert not npu_args.needs_compressed_mask(0)


def test_compressed_mask_exact():
    m = npu_args.compressed_causal_mask()
    assert m.shape == (2048, 2048) and m.dtype == torch.bool
    assert not m[5, 5] and m[5, 6] and not m[6, 5] and int(m.sum()) == 2048 * 2047 // 2


def test_lse_to_th():
    lse = torch.arange(6.0).view(3, 2, 1)
    assert torch.equal(npu_args.lse_to_th(lse, 3, 2), torch.arange(6.0).view(3, 2))
    with pytest.raises(ValueError):
        npu_args.lse_to_th(lse.view(3, 2), 3, 2)


def test_visible_rows_dense_exact():
    cu_q, cu_k = [0, 3, 4, 6], [0, 2, 2, 7]
    assert npu_args.visible_rows_dense(cu_q, cu_k, True).tolist() == [
        False, True, True, False, True, True]
    assert npu_args.visible_rows_dense(cu_q, cu_k, False).tolist() == [
        True, True, True, False, True, True]


def test_classify_ranges_exact():
    assert paged_plan.classify_ranges([0, 0, 0], [5, 5, 5], 9) == ("full", 5, 0)
    assert paged_plan.classify_ranges([0, 0, 0], [3, 4, 5], 9) == ("causal", 5, 0)
    assert paged_plan.classify_ranges([0, 0, 0], [0, 0, 1], 9) == ("causal", 1, 0)
    assert paged_plan.classify_ranges([1, 2, 3], [3, 4, 5], 9) == ("band", 5, 2)
    assert paged_plan.classify_ranges([0, 1, 2], [2, 3, 4], 9) == ("band", 4, 2)
    assert paged_plan.classify_ranges([2], [7], 9) == ("band", 7, 5)
    assert paged_plan.classify_ranges([0, 1, 0], [3, 4, 5], 9) is None
    assert paged_plan.classify_ranges([0, 0], [3, 7], 9) is None


def test_plan_paged_exact():
    # request 0: causal over 6 keys; request 1: decode with a window (band); request 2: odd
    # ranges -> one-row requests (row 5 aligned at block 4 -> shifted prefix, row 6 band).
    cu_q = [0, 3, 4, 7]
    lo = [0, 0, 0, 2, 4, 5, 0]
    hi = [4, 5, 6, 9, 6, 7, 0]
    calls, visible = paged_plan.plan_paged(cu_q, [6, 9, 8], 4, lo, hi)
    by_mask = {(c.mask, c.window): c for c in calls}
    assert len(by_mask) == len(calls) == 4
    causal = by_mask[("causal", None)]
    assert causal.query_rows() == [0, 1, 2] and causal.cu_seqlens_q() == [0, 3]
    assert causal.kv_lengths() == [6]
    assert npu_args.sparse_args(causal.interface_mask()) == (3, npu_args.MAX_TOKENS, 0)
    band7 = by_mask[("band", 7)]
    assert band7.query_rows() == [3] and band7.kv_lengths() == [9]
    assert npu_args.sparse_args(band7.interface_mask()) == (4, 6, 0)
    full = by_mask[("full", None)]
    assert full.requests == [paged_plan.VirtualRequest((4,), 2, 1, 2)]
    assert npu_args.sparse_args(full.interface_mask()) == (0, npu_args.MAX_TOKENS, npu_args.MAX_TOKENS)
    band2 = by_mask[("band", 2)]
    assert band2.requests == [paged_plan.VirtualRequest((5,), 2, 1, 3)]
    assert npu_args.sparse_args(band2.interface_mask()) == (4, 1, 0)
    assert visible.tolist() == [True] * 6 + [False]
    table = torch.tensor([[7, 8, 9], [1, 2, 3], [4, 5, 6]])
    assert npu_args.gather_block_table(table, full).tolist() == [[5, 6, 0]]
    assert npu_args.gather_block_table(table, causal).dtype == torch.int32


def test_plan_paged_no_ranges_is_one_call():
    calls, visible = paged_plan.plan_paged([0, 1, 3], [5, 0], 16, None, None)
    assert len(calls) == 1 and calls[0].mask == "full" and calls[0].window is None
    assert calls[0].cu_seqlens_q() == [0, 1] and calls[0].kv_lengths() == [5]
    assert visible.tolist() == [True, False, False]


def test_attention_update_inputs_and_slots():
    out = torch.randn(3, 2, 8)
    lse = torch.randn(3, 2, dtype=torch.float64)
    lses, outs = npu_args.attention_update_inputs(out, lse, out, lse)
    assert lses[0].shape == (6,) and lses[0].dtype == torch.float32
    assert outs[1].shape == (6, 8) and torch.equal(outs[0][3], out[1, 1])
    slots = npu_args.slot_mapping_arg(torch.tensor([3, -1, 7]), torch.device("cpu"))
    assert slots.dtype == torch.int32 and slots.tolist() == [3, -1, 7]


def test_library_imports_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    ops = NpuOps()
    with pytest.raises(RuntimeError, match="torch_npu"):
        ops.varlen_attention(*([torch.zeros(1, 1, 8, dtype=torch.float16)] * 3),
                             torch.tensor([0, 1]), torch.tensor([0, 1]), scale=1.0, causal=False)


# ---------------------------------------------------------------- end to end vs ReferenceOps

def _rand(gen, shape, dtype, device):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _cu(lengths):
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int64)


heads = st.sampled_from([(2, 2), (4, 1), (8, 2)])  # GQA ratios 1, 4, 4


@HYP
@given(data=st.data(), hq_hkv=heads, mode=st.sampled_from(["none", "causal", "window"]))
def test_varlen_matches_reference(backend, data, hq_hkv, mode):
    r = data.draw(st.integers(1, 4))
    q_lens = data.draw(st.lists(st.integers(0, 9), min_size=r, max_size=r))
    k_lens = data.draw(st.lists(st.integers(0, 12), min_size=r, max_size=r))
    window = data.draw(st.integers(1, 6)) if mode == "window" else None
    seed = data.draw(st.integers(0, 2**16))
    hq, hkv = hq_hkv
    for dtype in backend.dtypes:
        gen = torch.Generator().manual_seed(seed)
        d = backend.head_dim
        q = _rand(gen, (sum(q_lens), hq, d), dtype, backend.device)
        k = _rand(gen, (sum(k_lens), hkv, d), dtype, backend.device)
        v = _rand(gen, (sum(k_lens), hkv, d), dtype, backend.device)
        kw = dict(scale=d ** -0.5, causal=mode != "none", window=window)
        out, lse = backend.ops.varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw)
        ref = ReferenceOps().varlen_attention(q.cpu(), k.cpu(), v.cpu(), _cu(q_lens),
                                              _cu(k_lens), **kw)
        _assert_matches(out, lse, *ref, dtype)


@HYP
@given(data=st.data(), hq_hkv=heads, mode=st.sampled_from(["none", "causal", "window"]))
def test_varlen_seqused_k_matches_reference(backend, data, hq_hkv, mode):
    """seqused_k (< range, == range, 0) as actual_seq_lengths_kv of packed prefixes."""
    r = data.draw(st.integers(1, 4))
    q_lens = data.draw(st.lists(st.integers(0, 9), min_size=r, max_size=r))
    k_lens = data.draw(st.lists(st.integers(0, 12), min_size=r, max_size=r))
    used = torch.tensor([data.draw(st.sampled_from([0, n // 2, n])) for n in k_lens])
    window = data.draw(st.integers(1, 6)) if mode == "window" else None
    seed = data.draw(st.integers(0, 2**16))
    hq, hkv = hq_hkv
    for dtype in backend.dtypes:
        gen = torch.Generator().manual_seed(seed)
        d = backend.head_dim
        q = _rand(gen, (sum(q_lens), hq, d), dtype, backend.device)
        k = _rand(gen, (sum(k_lens), hkv, d), dtype, backend.device)
        v = _rand(gen, (sum(k_lens), hkv, d), dtype, backend.device)
        kw = dict(scale=d ** -0.5, causal=mode != "none", window=window, seqused_k=used)
        out, lse = backend.ops.varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw)
        ref = ReferenceOps().varlen_attention(q.cpu(), k.cpu(), v.cpu(), _cu(q_lens),
                                              _cu(k_lens), **kw)
        _assert_matches(out, lse, *ref, dtype)


def _ranges(data, q_lens, seq_lens, style, block_size):
    lo, hi = [], []
    for nq, n in zip(q_lens, seq_lens):
        end = data.draw(st.integers(0, n))
        w = data.draw(st.integers(1, max(n, 1)))
        for i in range(nq):
            if style == "causal":
                lo.append(data.draw(st.integers(-2, 0)))
                hi.append(end - nq + 1 + i)
            elif style == "band":
                hi.append(end - nq + 1 + i)
                lo.append(hi[-1] - w)
            else:  # arbitrary ranges, often starting on a block boundary
                aligned = block_size * data.draw(st.integers(0, n // block_size))
                lo.append(data.draw(st.sampled_from([aligned, aligned, -1]) | st.integers(-2, n + 1)))
                hi.append(data.draw(st.integers(-1, n + 2)))
    return torch.tensor(lo), torch.tensor(hi)


@HYP
@given(data=st.data(), hq_hkv=heads, block_size=st.sampled_from([16, 128]),
       style=st.sampled_from(["none", "causal", "band", "random", "decode"]))
def test_paged_matches_reference(backend, data, hq_hkv, block_size, style):
    r = data.draw(st.integers(1, 3))
    q_lens = data.draw(st.lists(st.integers(0 if style != "decode" else 1, 5 if style != "decode" else 1),
                                min_size=r, max_size=r))
    seq_lens = data.draw(st.lists(st.integers(0, 2 * block_size + 5), min_size=r, max_size=r))
    ranges = None if style in ("none",) else _ranges(
        data, q_lens, seq_lens, "random" if style == "decode" else style, block_size)
    seed = data.draw(st.integers(0, 2**16))
    hq, hkv = hq_hkv
    max_blocks = 3
    num_blocks = r * max_blocks + 2
    for dtype in backend.dtypes:
        gen = torch.Generator().manual_seed(seed)
        d = backend.head_dim
        kc = _rand(gen, (num_blocks, block_size, hkv, d), dtype, backend.device)
        vc = _rand(gen, (num_blocks, block_size, hkv, d), dtype, backend.device)
        table = torch.randperm(num_blocks, generator=gen)[: r * max_blocks].view(r, max_blocks)
        q = _rand(gen, (sum(q_lens), hq, d), dtype, backend.device)
        kw = dict(scale=d ** -0.5)
        if ranges is not None:
            kw.update(kv_start=ranges[0], kv_end=ranges[1])
        dev_kw = {k: (x.to(backend.device) if torch.is_tensor(x) else x) for k, x in kw.items()}
        out, lse = backend.ops.paged_attention(
            q, kc, vc, table.to(backend.device), _cu(q_lens), torch.tensor(seq_lens), **dev_kw)
        ref = ReferenceOps().paged_attention(q.cpu(), kc.cpu(), vc.cpu(), table, _cu(q_lens),
                                             torch.tensor(seq_lens), **kw)
        _assert_matches(out, lse, *ref, dtype)


@HYP
@given(seed=st.integers(0, 2**16), block_size=st.sampled_from([16, 128]),
       hkv=st.sampled_from([1, 2]))
def test_reshape_and_cache_matches_reference(backend, seed, block_size, hkv):
    gen = torch.Generator().manual_seed(seed)
    dtype, d, num_blocks, t = backend.dtypes[0], backend.head_dim, 3, 11
    key = _rand(gen, (t, hkv, d), dtype, backend.device)
    value = _rand(gen, (t, hkv, d), dtype, backend.device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.3] = -1
    caches = [_rand(gen, (num_blocks, block_size, hkv, d), dtype, backend.device) for _ in range(2)]
    ref = [c.cpu().clone() for c in caches]
    backend.ops.reshape_and_cache(key, value, caches[0], caches[1], slots.to(backend.device))
    ReferenceOps().reshape_and_cache(key.cpu(), value.cpu(), ref[0], ref[1], slots)
    assert torch.equal(caches[0].cpu(), ref[0]) and torch.equal(caches[1].cpu(), ref[1])


@HYP
@given(seed=st.integers(0, 2**16), t=st.integers(1, 9), d=st.sampled_from([8, 64]))
def test_merge_matches_reference(backend, seed, t, d):
    gen = torch.Generator().manual_seed(seed)
    out_a, out_b = (torch.randn(t, 3, d, generator=gen).to(backend.device) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, 3, generator=gen) * 3 for _ in range(2))
    lse_a[torch.rand(t, 3, generator=gen) < 0.3] = float("-inf")
    lse_b[torch.rand(t, 3, generator=gen) < 0.3] = float("-inf")
    lse_a[0, 0] = lse_b[0, 0] = float("-inf")
    out, lse = backend.ops.merge_attn_states(out_a, lse_a.to(backend.device), out_b,
                                             lse_b.to(backend.device))
    ref = ReferenceOps().merge_attn_states(out_a.cpu(), lse_a, out_b.cpu(), lse_b)
    _assert_matches(out, lse, *ref, torch.float32)


# ---------------------------------------------------------------- emulator-specific checks

@pytest.mark.skipif(REAL_NPU, reason="emulator only")
def test_kernels_are_really_called(monkeypatch):
    emu = npu_emulator.install(monkeypatch, strict=True)
    ops = NpuOps()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(7, 1, 16, generator=gen).to(torch.bfloat16)
    out, lse = ops.varlen_attention(q, k, k, torch.tensor([0, 5]), torch.tensor([0, 7]),
                                    scale=0.25, causal=True, window=3)
    assert emu.calls[-1] == ("fia", dict(batch=1, sparse_mode=4, pre_tokens=2, next_tokens=0,
                                         paged=False))
    ref = ReferenceOps().varlen_attention(q, k, k, torch.tensor([0, 5]), torch.tensor([0, 7]),
                                          scale=0.25, causal=True, window=3)
    _assert_matches(out, lse, *ref, torch.bfloat16)
    ops.merge_attn_states(out, lse, out, lse)
    assert emu.calls[-1][0] == "attention_update"
    # float32 inputs are not a fused-op dtype: they go to the reference path, no kernel call.
    n_calls = len(emu.calls)
    ops.varlen_attention(q.float(), k.float(), k.float(), torch.tensor([0, 5]),
                         torch.tensor([0, 7]), scale=0.25, causal=True)
    assert len(emu.calls) == n_calls


@pytest.mark.skipif(REAL_NPU, reason="emulator only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strict_half_precision_paged(monkeypatch, dtype):
    npu_emulator.install(monkeypatch, strict=True)
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(6, 16, 2, 32, generator=gen).to(dtype)
    vc = torch.randn(6, 16, 2, 32, generator=gen).to(dtype)
    q = torch.randn(6, 8, 32, generator=gen).to(dtype)
    table = torch.tensor([[3, 1, 0], [5, 2, 4]])
    args = (q, kc, vc, table, torch.tensor([0, 4, 6]), torch.tensor([40, 19]))
    kw = dict(scale=32 ** -0.5, kv_start=torch.tensor([0, 0, 0, 0, 5, 9]),
              kv_end=torch.tensor([37, 38, 39, 40, 18, 19]))
    _assert_matches(*NpuOps().paged_attention(*args, **kw),
                    *ReferenceOps().paged_attention(*args, **kw), dtype)


@pytest.mark.skipif(REAL_NPU, reason="emulator only")
def test_emulator_rejects_wrong_conventions(monkeypatch):
    emu = npu_emulator.install(monkeypatch, strict=True)
    q = torch.zeros(4, 2, 16, dtype=torch.float16)
    base = dict(num_heads=2, input_layout="TND", softmax_lse_flag=True, scale=1.0)
    with pytest.raises(npu_emulator.EmulatorError, match="python list"):
        emu.npu_fused_infer_attention_score(q, q, q, actual_seq_lengths=torch.tensor([4]),
                                            actual_seq_lengths_kv=[4], **base)
    with pytest.raises(npu_emulator.EmulatorError, match="compressed"):
        emu.npu_fused_infer_attention_score(q, q, q, actual_seq_lengths=[4],
                                            actual_seq_lengths_kv=[4], sparse_mode=3, **base)
    with pytest.raises(npu_emulator.EmulatorError, match="float16/bfloat16"):
        emu.npu_fused_infer_attention_score(q.float(), q.float(), q.float(), actual_seq_lengths=[4],
                                            actual_seq_lengths_kv=[4], **base)
