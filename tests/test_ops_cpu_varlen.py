"""The C++ prefill kernel (``CpuOps.varlen_attention``) against ReferenceOps and the float64
oracle.

Inputs of every dtype are compared with the float64 computation on the *same* (rounded) values,
so the only error left is the kernel's float32 accumulation: the tolerance is tight for bf16
and fp16 too.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cp_attention.ops import CpuOps, ReferenceOps
from cp_attention.ops.cpu_build import load_cpu_extension
from cp_attention.testing.dense import dense_attention

REF = ReferenceOps()
OUT_TOL = 2e-5   # max |out - out64|; outputs are averages of N(0, 1) values
LSE_TOL = 2e-5   # max |lse - lse64| on rows that see keys


@pytest.fixture(scope="module")
def kernel(cpu_ops) -> CpuOps:
    return cpu_ops


def _run(kernel, q, k, v, cu_q, cu_k, scale, causal, window, threads=1):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel.varlen_attention(q, k, v, cu_q, cu_k, scale=scale, causal=causal,
                                       window=window)
    finally:
        torch.set_num_threads(previous)


def _oracle(q, k, v, lens_q, lens_k, scale, causal, window):
    """Float64 dense attention, request by request."""
    outs, lses, qs, ks = [], [], 0, 0
    for nq, nk in zip(lens_q, lens_k):
        pos = torch.arange(nq) + (nk - nq)
        o, l = dense_attention(q[qs:qs + nq], k[ks:ks + nk], v[ks:ks + nk], pos, scale, causal,
                               window)
        outs.append(o)
        lses.append(l)
        qs, ks = qs + nq, ks + nk
    return torch.cat(outs), torch.cat(lses)


def _assert_close(out, lse, ref_out, ref_lse):
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out[empty] == 0).all()
    if out.numel():
        assert (out.double() - ref_out).abs().max().item() <= OUT_TOL
    if (~empty).any():
        assert (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() <= LSE_TOL


def _make(lens_q, lens_k, hq, hkv, d, dtype, seed, layout="contiguous"):
    """q [Tq, hq, d], k/v [Tk, hkv, d] in ``dtype``; layout 'strided' gives non-contiguous views."""
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    if layout == "strided":  # heads interleaved in a wider buffer, K and V sharing rows
        q = torch.randn(tq, hq * 2, d, generator=gen).to(dtype)[:, ::2]
        kv = torch.randn(tk, 2, hkv, d, generator=gen).to(dtype)
        k, v = kv[:, 0], kv[:, 1]
    elif layout == "head_major":  # [H, T, D] storage seen as [T, H, D]
        q = torch.randn(hq, tq, d, generator=gen).to(dtype).transpose(0, 1)
        k = torch.randn(hkv, tk, d, generator=gen).to(dtype).transpose(0, 1)
        v = torch.randn(hkv, tk, d, generator=gen).to(dtype).transpose(0, 1)
    else:
        q = torch.randn(tq, hq, d, generator=gen).to(dtype)
        k = torch.randn(tk, hkv, d, generator=gen).to(dtype)
        v = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    cu_q = torch.tensor([0] + list(lens_q)).cumsum(0)
    cu_k = torch.tensor([0] + list(lens_k)).cumsum(0)
    return q, k, v, cu_q, cu_k


@settings(max_examples=60, deadline=None, derandomize=True)
@given(lens=st.lists(st.tuples(st.integers(0, 130), st.integers(0, 230)), min_size=1, max_size=4),
       head_size=st.sampled_from([64, 80, 128, 256]), group=st.sampled_from([1, 4, 8]),
       num_kv_heads=st.sampled_from([1, 2]), causal=st.booleans(),
       window=st.sampled_from([None, 1, 5, 33, 150]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       threads=st.sampled_from([1, 2]),
       layout=st.sampled_from(["contiguous", "strided", "head_major"]),
       cu_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_matches_float64_oracle(kernel, lens, head_size, group, num_kv_heads, causal, window,
                                dtype, threads, layout, cu_dtype):
    window = window if causal else None
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    seed = sum(lens_q) * 1009 + sum(lens_k) * 7 + head_size + group
    q, k, v, cu_q, cu_k = _make(lens_q, lens_k, num_kv_heads * group, num_kv_heads, head_size,
                                dtype, seed, layout)
    scale = head_size ** -0.5
    out, lse = _run(kernel, q, k, v, cu_q.to(cu_dtype), cu_k.to(cu_dtype), scale, causal,
                    window, threads)
    ref_out, ref_lse = _oracle(q, k, v, lens_q, lens_k, scale, causal, window)
    _assert_close(out, lse, ref_out, ref_lse)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(lens=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 300)), min_size=1, max_size=3),
       group=st.sampled_from([1, 4]), causal=st.booleans(),
       window=st.sampled_from([None, 7, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_matches_reference_ops(kernel, lens, group, causal, window, dtype):
    """Same inputs through ReferenceOps (computing in float64 on the same values)."""
    window = window if causal else None
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    q, k, v, cu_q, cu_k = _make(lens_q, lens_k, 2 * group, 2, 64, dtype, sum(lens_q) + 3)
    out, lse = _run(kernel, q, k, v, cu_q, cu_k, 0.125, causal, window)
    ref_out, ref_lse = REF.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k,
                                            scale=0.125, causal=causal, window=window)
    _assert_close(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("nq, nk", [(1, 1), (1, 500), (7, 3), (300, 100), (97, 97), (96, 192),
                                    (193, 193), (2, 0), (0, 5)])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 1), (True, 96)])
def test_edge_lengths(kernel, nq, nk, causal, window):
    """One token, more queries than keys (leading rows see nothing), tile boundaries, empty."""
    q, k, v, cu_q, cu_k = _make([nq], [nk], 8, 2, 64, torch.float32, nq * 31 + nk)
    out, lse = _run(kernel, q, k, v, cu_q, cu_k, 0.125, causal, window)
    ref_out, ref_lse = _oracle(q, k, v, [nq], [nk], 0.125, causal, window)
    _assert_close(out, lse, ref_out, ref_lse)
    if causal and nq > nk:
        assert torch.isneginf(lse[:nq - nk]).all() and (out[:nq - nk] == 0).all()


def test_many_short_requests_and_threads_agree(kernel):
    """Many short requests; 1 and 2 threads give bit-identical results (no shared state)."""
    lens_q = [1, 3, 0, 17, 5, 96, 2, 40] * 4
    lens_k = [1, 3, 4, 17, 9, 96, 200, 40] * 4
    q, k, v, cu_q, cu_k = _make(lens_q, lens_k, 32, 8, 128, torch.bfloat16, 5)
    one = _run(kernel, q, k, v, cu_q, cu_k, 128 ** -0.5, True, None, threads=1)
    two = _run(kernel, q, k, v, cu_q, cu_k, 128 ** -0.5, True, None, threads=2)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    _assert_close(*one, *_oracle(q, k, v, lens_q, lens_k, 128 ** -0.5, True, None))


def test_head_size_not_a_multiple_of_eight(kernel):
    q, k, v, cu_q, cu_k = _make([30, 9], [50, 9], 4, 1, 36, torch.float32, 11)
    out, lse = _run(kernel, q, k, v, cu_q, cu_k, 0.2, True, 6)
    _assert_close(out, lse, *_oracle(q, k, v, [30, 9], [50, 9], 0.2, True, 6))


@pytest.mark.parametrize("head_size, key_step", [(36, 1), (35, 1), (64, 2)])
def test_bf16_key_layouts(kernel, head_size, key_step):
    """bf16 keys read in place as pairs (even D, contiguous rows; avx512_bf16 builds) and the
    widening path for an odd D or keys whose elements are not adjacent (key_step 2)."""
    q, k, v, cu_q, cu_k = _make([40, 7], [130, 7], 4, 2, head_size, torch.bfloat16, head_size)
    if key_step > 1:
        k = torch.stack([k, torch.zeros_like(k)], dim=-1).flatten(-2)[..., ::key_step]
        assert k.stride(2) == key_step
    out, lse = _run(kernel, q, k, v, cu_q, cu_k, head_size ** -0.5, True, None)
    _assert_close(out, lse, *_oracle(q, k, v, [40, 7], [130, 7], head_size ** -0.5, True, None))


def test_large_scores_do_not_overflow(kernel):
    """Scores in the hundreds: the running max keeps every exponent <= 0."""
    q, k, v, cu_q, cu_k = _make([120], [120], 2, 1, 64, torch.float32, 3)
    out, lse = _run(kernel, q * 8, k * 8, v, cu_q, cu_k, 1.0, True, None)
    assert out.dtype == torch.float32
    ref_out, ref_lse = _oracle(q * 8, k * 8, v, [120], [120], 1.0, True, None)
    # float32 scores of ~2000 carry ~1e-4 absolute rounding: bound by PyTorch's float32 error
    f32_out, f32_lse = REF.varlen_attention(q * 8, k * 8, v, cu_q, cu_k, scale=1.0, causal=True)
    assert not torch.isinf(lse).any() and not torch.isnan(out).any()
    bound_out = 3 * (f32_out.double() - ref_out).abs().max().item() + 1e-5
    bound_lse = 3 * (f32_lse.double() - ref_lse).abs().max().item() + 1e-5
    assert (out.double() - ref_out).abs().max().item() <= bound_out
    assert (lse.double() - ref_lse).abs().max().item() <= bound_lse


@pytest.mark.parametrize("bad", ["window_without_causal", "float64", "mixed_dtypes", "heads",
                                 "cu_mismatch", "cu_decreasing"])
def test_rejects_bad_arguments(kernel, bad):
    """The C++ entry point checks what it relies on (CpuOps leaves value checks to callers)."""
    q, k, v, cu_q, cu_k = _make([4], [4], 4, 2, 64, torch.float32, 0)
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, causal=True, window=0)
    if bad == "window_without_causal":
        args.update(causal=False, window=3)
    elif bad == "float64":
        args.update(q=q.double(), k=k.double(), v=v.double())
    elif bad == "mixed_dtypes":
        args.update(k=k.bfloat16())
    elif bad == "heads":
        args.update(q=q[:, :3])
    elif bad == "cu_mismatch":
        args.update(cu_k=torch.tensor([0, 3]))
    else:
        args.update(cu_q=torch.tensor([0, 5, 4]), cu_k=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError):
        load_cpu_extension().varlen_attention(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"],
                                0.125, args["causal"], args["window"])


def _used_prefixes(k, v, lens_k, used):
    """The first used[i] keys of each request's range, packed: what seqused_k attends."""
    starts = [sum(lens_k[:i]) for i in range(len(lens_k))]
    rows = torch.cat([torch.arange(s, s + u) for s, u in zip(starts, used)] +
                     [torch.zeros(0, dtype=torch.long)])
    return k[rows], v[rows]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(lens=st.lists(st.tuples(st.integers(0, 130), st.integers(0, 230), st.floats(0, 1)),
                     min_size=1, max_size=4),
       used_kind=st.sampled_from(["fraction", "full", "zero"]),
       head_size=st.sampled_from([64, 80, 128]), group=st.sampled_from([1, 4]),
       num_kv_heads=st.sampled_from([1, 2]), causal=st.booleans(),
       window=st.sampled_from([None, 1, 5, 150]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       threads=st.sampled_from([1, 2]), layout=st.sampled_from(["contiguous", "strided"]),
       cu_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_seqused_k_matches_float64_oracle(kernel, lens, used_kind, head_size, group,
                                          num_kv_heads, causal, window, dtype, threads, layout,
                                          cu_dtype):
    """seqused_k < range, == range and 0: request i attends the first seqused_k[i] keys of its
    range, causal / window aligned to that count; the same as packing those prefixes."""
    window = window if causal else None
    lens_q, lens_k = [a for a, _, _ in lens], [b for _, b, _ in lens]
    used = {"full": lens_k, "zero": [0] * len(lens),
            "fraction": [int(b * f) for _, b, f in lens]}[used_kind]
    seed = sum(lens_q) * 1013 + sum(used) * 5 + head_size + group
    q, k, v, cu_q, cu_k = _make(lens_q, lens_k, num_kv_heads * group, num_kv_heads, head_size,
                                dtype, seed, layout)
    scale = head_size ** -0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = kernel.varlen_attention(q, k, v, cu_q.to(cu_dtype), cu_k.to(cu_dtype),
                                           scale=scale, causal=causal, window=window,
                                           seqused_k=torch.tensor(used, dtype=cu_dtype))
    finally:
        torch.set_num_threads(previous)
    k_used, v_used = _used_prefixes(k, v, lens_k, used)
    _assert_close(out, lse, *_oracle(q, k_used, v_used, lens_q, used, scale, causal, window))
    ref = REF.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, scale=scale,
                               causal=causal, window=window, seqused_k=torch.tensor(used))
    _assert_close(out, lse, *ref)


@pytest.mark.parametrize("used", [[-1, 2], [5, 2], [1]])
def test_seqused_k_out_of_range_is_rejected(kernel, used):
    q, k, v, cu_q, cu_k = _make([2, 2], [4, 3], 4, 2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="seqused_k"):
        load_cpu_extension().varlen_attention(q, k, v, cu_q, cu_k, 0.125, True, 0,
                                              torch.tensor(used))
