"""Contract tests of CudaOps on CPU: pure argument preparation, a fake ``flash_attn`` that
implements flash-attn 2's documented varlen semantics in float64, and the explicit-math
fallback, all against ReferenceOps. The GPU run is ``launch/gpu_check.py``."""
from __future__ import annotations

import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_attention.ops import cuda_args, paged_plan
from cp_attention.ops.cuda import CudaOps
from cp_attention.ops.interface import Mask, used_key_lengths, used_key_rows
from cp_attention.ops.reference import ReferenceOps

HYP = settings(max_examples=20, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture])


def make_flash_attn(strict: bool = True, seqused_k: bool = True) -> types.ModuleType:
    """Fake flash_attn: ``flash_attn_varlen_func`` with flash-attn 2 semantics (bottom-right
    causal, window_size, LSE [H, total_q], +inf LSE / zero output for rows with no key) and,
    with ``seqused_k``, vllm_flash_attn's ``seqused_k`` keyword (request i uses the first
    seqused_k[i] keys of its range; flash-attn 2's Python wrapper has no such keyword)."""
    mod = types.ModuleType("flash_attn")
    mod.calls = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None,
                               seqused_k=None):
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert seqused_k is None or (seqused_k.dtype == torch.int32 and seqused_k.dim() == 1)
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        assert dropout_p == 0.0 and block_table is None
        if strict:
            assert q.dtype in (torch.float16, torch.bfloat16)
        bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(bq, bq[1:]))
        assert max_seqlen_k == max(b - a for a, b in zip(bk, bk[1:]))
        mod.calls.append(dict(causal=causal, window_size=tuple(window_size)))
        mod.seqused_k_given = seqused_k is not None
        t, h, d = q.shape
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        group = h // k.shape[1]
        out = torch.zeros(t, h, d, dtype=torch.float64)
        lse = torch.full((h, t), float("inf"), dtype=torch.float64)
        left, right = window_size
        for r in range(len(bq) - 1):
            nq, nk = bq[r + 1] - bq[r], bk[r + 1] - bk[r]
            if seqused_k is not None:
                assert 0 <= int(seqused_k[r]) <= nk
                nk = int(seqused_k[r])
            if nq == 0 or nk == 0:
                continue
            pos = (torch.arange(nq) + nk - nq)[:, None]
            key = torch.arange(nk)[None]
            vis = torch.ones(nq, nk, dtype=torch.bool)
            if causal:
                vis &= key <= pos
            if left >= 0:
                vis &= key >= pos - left
            if right >= 0:
                vis &= key <= pos + right
            kk = k[bk[r]:bk[r] + nk].double().repeat_interleave(group, 1)
            vv = v[bk[r]:bk[r] + nk].double().repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q[bq[r]:bq[r + 1]].double(), kk) * scale
            s = s.masked_fill(~vis[None], float("-inf"))
            l = torch.logsumexp(s, -1)
            p = torch.exp(s - torch.where(torch.isinf(l), torch.zeros_like(l), l)[..., None])
            out[bq[r]:bq[r + 1]] = torch.einsum("hqk,khd->qhd", p, vv)
            lse[:, bq[r]:bq[r + 1]] = torch.where(torch.isneginf(l), float("inf"), l)
        o = out.to(q.dtype)
        l32 = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        return (o, l32, None) if return_attn_probs else o

    if not seqused_k:  # flash-attn 2's signature
        def flash2_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, dropout_p, softmax_scale, causal,
                                          window_size, softcap, alibi_slopes, deterministic,
                                          return_attn_probs, block_table)
        mod.flash_attn_varlen_func = flash2_varlen_func
    else:
        mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


@pytest.fixture(params=["flash-emulated", "explicit"])
def cuda_ops(request, monkeypatch):
    """CudaOps over the fake flash_attn (float64 allowed) or over the explicit fallback."""
    return _cuda_ops(request.param, monkeypatch)


def _cuda_ops(kind, monkeypatch):
    if kind == "explicit":
        monkeypatch.setitem(sys.modules, "flash_attn", None)
        ops = CudaOps()
        assert ops._flash is None
        return ops, None
    fake = make_flash_attn(strict=False, seqused_k=kind == "flash-emulated")
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    ops = CudaOps()
    monkeypatch.setattr(cuda_args, "FLASH_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    return ops, fake


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out)


def _check(out, lse, ref_out, ref_lse, tight=True):
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    tol = dict(rtol=1e-9, atol=1e-9) if tight else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], **(tol if tight else dict(rtol=1e-3,
                                                                                  atol=1e-3)))


# ---------------------------------------------------------------- pure argument preparation

def test_window_size_exact():
    """flash-attn's window_size is the mask's bounds."""
    assert Mask(False).bounds == (-1, -1)
    assert Mask(True).bounds == (-1, 0)
    assert Mask(True, 4).bounds == (3, 0)
    with pytest.raises(ValueError):
        Mask(False, 2)


def test_small_helpers_exact():
    cu = cuda_args.int32_cu_seqlens(torch.tensor([0, 2, 5]), torch.device("cpu"))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5]
    assert cuda_args.max_seqlen([0, 2, 5, 5]) == 3 and cuda_args.max_seqlen([0]) == 0
    assert torch.equal(cuda_args.lse_to_th(torch.arange(6.0).view(2, 3), 3, 2),
                       torch.arange(6.0).view(2, 3).T)
    assert cuda_args.dense_visibility(2, 4, Mask(True, 2)).tolist() == [
        [False, True, True, False], [False, False, True, True]]
    assert cuda_args.dense_visibility(3, 1, Mask(True)).tolist() == [[False], [False], [True]]
    assert cuda_args.dense_visibility(2, 3, Mask(False)).all()


def test_paged_gather_exact():
    call = paged_plan.KernelCall("full", None, [paged_plan.VirtualRequest((0,), 1, 1, 3),
                                                paged_plan.VirtualRequest((1, 2), 0, 0, 5)])
    table = torch.tensor([[2, 0, 1], [3, 4, 5]])
    slots, bounds = cuda_args.paged_gather(table, call, 4)
    assert slots.tolist() == [16, 17, 18, 8, 9, 10, 11, 0]
    assert bounds == [0, 3, 8]
    assert paged_plan.KernelCall("band", 3).interface_mask() == Mask(True, 3)
    assert paged_plan.KernelCall("causal").interface_mask() == Mask(True, None)
    assert call.interface_mask() == Mask(False, None)


# ---------------------------------------------------------------- end to end vs ReferenceOps

heads = st.sampled_from([(2, 2), (4, 1), (8, 2)])


@HYP
@given(data=st.data(), hq_hkv=heads, mode=st.sampled_from(["none", "causal", "window"]))
def test_varlen_matches_reference(cuda_ops, data, hq_hkv, mode):
    ops, _ = cuda_ops
    r = data.draw(st.integers(1, 4))
    q_lens = data.draw(st.lists(st.integers(0, 9), min_size=r, max_size=r))
    k_lens = data.draw(st.lists(st.integers(0, 12), min_size=r, max_size=r))
    window = data.draw(st.integers(1, 6)) if mode == "window" else None
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    hq, hkv = hq_hkv
    q = torch.randn(sum(q_lens), hq, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(k_lens), hkv, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(k_lens), hkv, 16, generator=gen, dtype=torch.float64)
    kw = dict(scale=0.25, causal=mode != "none", window=window)
    _check(*ops.varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw),
           *ReferenceOps().varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw))


@HYP
@given(data=st.data(), hq_hkv=heads, block_size=st.sampled_from([16, 128]),
       style=st.sampled_from(["none", "causal", "band", "random"]))
def test_paged_matches_reference(cuda_ops, data, hq_hkv, block_size, style):
    ops, _ = cuda_ops
    r = data.draw(st.integers(1, 3))
    q_lens = data.draw(st.lists(st.integers(0, 5), min_size=r, max_size=r))
    seq_lens = data.draw(st.lists(st.integers(0, 2 * block_size + 5), min_size=r, max_size=r))
    lo, hi = [], []
    for nq, n in zip(q_lens, seq_lens):
        end, w = data.draw(st.integers(0, n)), data.draw(st.integers(1, max(n, 1)))
        for i in range(nq):
            if style == "random":
                aligned = block_size * data.draw(st.integers(0, n // block_size))
                lo.append(data.draw(st.sampled_from([aligned, -1]) | st.integers(-2, n + 1)))
                hi.append(data.draw(st.integers(-1, n + 2)))
            else:
                hi.append(end - nq + 1 + i)
                lo.append(hi[-1] - w if style == "band" else 0)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    hq, hkv = hq_hkv
    nb = 3 * r + 2
    kc = torch.randn(nb, block_size, hkv, 16, generator=gen, dtype=torch.float64)
    vc = torch.randn(nb, block_size, hkv, 16, generator=gen, dtype=torch.float64)
    table = torch.randperm(nb, generator=gen)[: 3 * r].view(r, 3)
    q = torch.randn(sum(q_lens), hq, 16, generator=gen, dtype=torch.float64)
    kw = dict(scale=0.25)
    if style != "none":
        kw.update(kv_start=torch.tensor(lo, dtype=torch.long), kv_end=torch.tensor(hi, dtype=torch.long))
    args = (q, kc, vc, table, _cu(q_lens), torch.tensor(seq_lens))
    _check(*ops.paged_attention(*args, **kw), *ReferenceOps().paged_attention(*args, **kw))


def test_flash_path_is_really_used_in_half_precision(monkeypatch):
    fake = make_flash_attn(strict=True)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    ops = CudaOps()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(7, 4, 32, generator=gen).to(torch.bfloat16)
    k = torch.randn(9, 2, 32, generator=gen).to(torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 3, 7]), torch.tensor([0, 2, 9])
    out, lse = ops.varlen_attention(q, k, k, cu_q, cu_k, scale=0.2, causal=True, window=3)
    assert fake.calls[-1] == dict(causal=True, window_size=(2, 0))
    ref = ReferenceOps().varlen_attention(q, k, k, cu_q, cu_k, scale=0.2, causal=True, window=3)
    _check(out, lse, *ref, tight=False)
    n = len(fake.calls)
    ops.varlen_attention(q.float(), k.float(), k.float(), cu_q, cu_k, scale=0.2, causal=True)
    assert len(fake.calls) == n  # float32 is not a flash-attn dtype: explicit path


def test_reshape_and_cache_and_merge(cuda_ops):
    ops, _ = cuda_ops
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(2, 6, 2, 8, generator=gen)
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(4)]
    slots = torch.tensor([5, -1, 0, 7, -1, 2])
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    ReferenceOps().reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    lse_a = torch.tensor([[0.5, float("-inf")], [float("-inf"), float("-inf")]])
    lse_b = torch.tensor([[1.0, 2.0], [float("-inf"), 0.0]])
    oa, ob = torch.randn(2, 2, 2, 3, generator=gen)
    _check(*ops.merge_attn_states(oa, lse_a, ob, lse_b),
           *ReferenceOps().merge_attn_states(oa, lse_a, ob, lse_b))


@pytest.mark.parametrize("kind", ["flash-emulated", "flash2-emulated", "explicit"])
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), hq_hkv=heads, mode=st.sampled_from(["none", "causal", "window"]))
def test_varlen_seqused_k_matches_reference(monkeypatch, kind, data, hq_hkv, mode):
    """seqused_k (< range, == range, 0) through flash-attn with the keyword (vllm_flash_attn),
    without it (flash-attn 2: prefixes packed) and the explicit math: as ReferenceOps."""
    ops, fake = _cuda_ops(kind, monkeypatch)
    r = data.draw(st.integers(1, 4))
    q_lens = data.draw(st.lists(st.integers(0, 9), min_size=r, max_size=r))
    k_lens = data.draw(st.lists(st.integers(0, 12), min_size=r, max_size=r))
    used = [data.draw(st.sampled_from([0, n // 2, n])) for n in k_lens]
    window = data.draw(st.integers(1, 6)) if mode == "window" else None
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    hq, hkv = hq_hkv
    q = torch.randn(sum(q_lens), hq, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(k_lens), hkv, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(k_lens), hkv, 16, generator=gen, dtype=torch.float64)
    kw = dict(scale=0.25, causal=mode != "none", window=window, seqused_k=torch.tensor(used))
    _check(*ops.varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw),
           *ReferenceOps().varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw))
    if fake is not None and fake.calls:
        assert fake.seqused_k_given == (kind == "flash-emulated")


def test_used_prefix_helpers_exact():
    assert used_key_lengths([0, 4, 4, 9], None) == [4, 0, 5]
    assert used_key_lengths([0, 4, 4, 9], [2, 0, 5]) == [2, 0, 5]
    with pytest.raises(ValueError, match="seqused_k"):
        used_key_lengths([0, 4, 9], [5, 1])
    rows, bounds = used_key_rows([0, 4, 4, 9], [2, 0, 3])
    assert rows.tolist() == [0, 1, 4, 5, 6] and bounds == [0, 2, 2, 5]
    assert cuda_args.takes_seqused_k(make_flash_attn().flash_attn_varlen_func)
    assert not cuda_args.takes_seqused_k(make_flash_attn(seqused_k=False).flash_attn_varlen_func)
