"""The portable ops against the float64 oracle (randomized, fixed seeds)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cp_attention.ops import ReferenceOps, merge_attn_states, merge_many
from cp_attention.testing.dense import dense_attention

OPS = ReferenceOps()
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float64: 1e-12}


def _dense_varlen(q, k, v, lens_q, lens_k, scale, causal, window):
    outs, lses, qs, ks = [], [], 0, 0
    for nq, nk in zip(lens_q, lens_k):
        pos = torch.arange(nq) + (nk - nq)
        o, l = dense_attention(q[qs:qs + nq], k[ks:ks + nk], v[ks:ks + nk], pos, scale, causal, window)
        outs.append(o)
        lses.append(l)
        qs, ks = qs + nq, ks + nk
    return torch.cat(outs), torch.cat(lses)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 60)), min_size=1, max_size=5),
       group=st.sampled_from([1, 4]), causal=st.booleans(),
       window=st.sampled_from([None, 1, 5, 33]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_varlen_attention_matches_dense(lens, group, causal, window, dtype):
    if window is not None and not causal:
        window = None
    lens_q = [a for a, _ in lens]
    lens_k = [b for _, b in lens]
    gen = torch.Generator().manual_seed(sum(lens_q) * 7 + sum(lens_k))
    hkv, d = 2, 16
    q = torch.randn(sum(lens_q), hkv * group, d, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype)
    cu_q = torch.tensor([0] + lens_q).cumsum(0)
    cu_k = torch.tensor([0] + lens_k).cumsum(0)
    out, lse = OPS.varlen_attention(q, k, v, cu_q, cu_k, scale=0.25, causal=causal, window=window)
    ref_out, ref_lse = _dense_varlen(q, k, v, lens_q, lens_k, 0.25, causal, window)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out.double() - ref_out).abs().max().item() <= TOL[dtype] if len(out) else True
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out[empty] == 0).all()
    if (~empty).any():
        assert (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() <= TOL[dtype] * 10


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seq_lens=st.lists(st.integers(0, 300), min_size=1, max_size=4),
       q_lens=st.lists(st.integers(0, 5), min_size=4, max_size=4),
       block_size=st.sampled_from([16, 128]), group=st.sampled_from([1, 4]),
       ranged=st.booleans())
def test_paged_attention_matches_dense(seq_lens, q_lens, block_size, group, ranged):
    q_lens = q_lens[:len(seq_lens)]
    gen = torch.Generator().manual_seed(sum(seq_lens) + 31 * sum(q_lens))
    hkv, d = 2, 8
    blocks_per_req = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen)
    start = 0
    keys, values = [], []
    for r, nb in enumerate(blocks_per_req):
        table[r, :nb] = perm[start:start + nb]
        start += nb
        keys.append(kc[table[r, :nb].long()].flatten(0, 1)[:seq_lens[r]])
        values.append(vc[table[r, :nb].long()].flatten(0, 1)[:seq_lens[r]])
    kv_start = kv_end = None
    if ranged:
        kv_start = torch.randint(0, 200, (sum(q_lens),), generator=gen)
        kv_end = kv_start + torch.randint(0, 150, (sum(q_lens),), generator=gen)
    out, lse = OPS.paged_attention(q, kc, vc, table, torch.tensor([0] + q_lens).cumsum(0),
                                   torch.tensor(seq_lens), scale=0.3, kv_start=kv_start, kv_end=kv_end)
    qs = 0
    for r, nq in enumerate(q_lens):
        for i in range(qs, qs + nq):
            lo, hi = 0, seq_lens[r]
            if ranged:
                lo, hi = min(int(kv_start[i]), hi), min(int(kv_end[i]), hi)
            if hi <= lo:
                assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
                continue
            ref, ref_lse = dense_attention(q[i:i + 1], keys[r][lo:hi], values[r][lo:hi],
                                           torch.tensor([hi - lo]), 0.3, causal=False)
            assert (out[i:i + 1].double() - ref).abs().max() <= 2e-5
            assert (lse[i:i + 1].double() - ref_lse).abs().max() <= 1e-4
        qs += nq


def test_reshape_and_cache_skips_minus_one():
    kc = torch.zeros(3, 4, 2, 8)
    vc = torch.zeros(3, 4, 2, 8)
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8)
    slots = torch.tensor([0, -1, 7, 11, -1])
    OPS.reshape_and_cache(key, value, kc, vc, slots)
    flat_k, flat_v = kc.view(12, 2, 8), vc.view(12, 2, 8)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[row]) and torch.equal(flat_v[slot], value[row])
    written = {0, 7, 11}
    for slot in range(12):
        if slot not in written:
            assert (flat_k[slot] == 0).all() and (flat_v[slot] == 0).all()


def test_merge_is_exact_and_inf_safe():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(10, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(10, 2, 8, generator=gen, dtype=torch.float64)
    full, full_lse = dense_attention(q, k, v, torch.full((6,), 99), 0.5, causal=False)
    a, la = dense_attention(q, k[:4], v[:4], torch.full((6,), 99), 0.5, causal=False)
    b, lb = dense_attention(q, k[4:], v[4:], torch.full((6,), 99), 0.5, causal=False)
    out, lse = merge_attn_states(a, la, b, lb)
    assert (out - full).abs().max() < 1e-12 and (lse - full_lse).abs().max() < 1e-12
    empty_lse = torch.full_like(la, float("-inf"))
    out, lse = merge_attn_states(a, la, torch.zeros_like(a), empty_lse)
    assert torch.equal(out, a) and torch.equal(lse, la)
    out, lse = merge_attn_states(torch.zeros_like(a), empty_lse, torch.zeros_like(a), empty_lse)
    assert (out == 0).all() and torch.isneginf(lse).all() and not torch.isnan(out).any()
    out, lse = merge_many(torch.stack([a, b, torch.zeros_like(a)]), torch.stack([la, lb, empty_lse]))
    assert (out - full).abs().max() < 1e-12


def test_sliding_window_without_causal_is_rejected():
    q = torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match="sliding window requires causal"):
        OPS.varlen_attention(q, q, q, torch.tensor([0, 3]), torch.tensor([0, 3]), scale=1.0,
                             causal=False, window=2)


def test_reshape_and_cache_into_strided_view():
    # vLLM's CPU layout [blocks, heads, block_size, 2 * D] viewed as [blocks, block_size, heads, D]
    packed = torch.zeros(3, 2, 4, 16)
    key_view = packed[..., :8].permute(0, 2, 1, 3)
    value_view = packed[..., 8:].permute(0, 2, 1, 3)
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    OPS.reshape_and_cache(key, value, key_view, value_view, torch.tensor([5, -1, 11]))
    assert torch.equal(packed[1, :, 1, :8], key[0]) and torch.equal(packed[2, :, 3, 8:], value[2])
    untouched = packed.clone()
    untouched[1, :, 1] = 0  # slot 5: key and value halves
    untouched[2, :, 3] = 0  # slot 11
    assert (untouched == 0).all()  # nothing else written


@settings(max_examples=40, deadline=None, derandomize=True)
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 60), st.floats(0, 1)),
                     min_size=1, max_size=5),
       used_kind=st.sampled_from(["fraction", "full", "zero"]), group=st.sampled_from([1, 4]),
       causal=st.booleans(), window=st.sampled_from([None, 1, 5, 33]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_varlen_seqused_k_matches_dense(lens, used_kind, group, causal, window, dtype):
    """seqused_k (< range, == range, 0): request i attends the first seqused_k[i] keys of its
    range, with n_k = seqused_k[i] for the causal / window alignment."""
    window = window if causal else None
    lens_q, lens_k = [a for a, _, _ in lens], [b for _, b, _ in lens]
    used = {"full": lens_k, "zero": [0] * len(lens),
            "fraction": [int(b * f) for _, b, f in lens]}[used_kind]
    gen = torch.Generator().manual_seed(sum(lens_q) * 7 + sum(used))
    hkv, d = 2, 16
    q = torch.randn(sum(lens_q), hkv * group, d, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype)
    cu_q = torch.tensor([0] + lens_q).cumsum(0)
    cu_k = torch.tensor([0] + lens_k).cumsum(0)
    out, lse = OPS.varlen_attention(q, k, v, cu_q, cu_k, scale=0.25, causal=causal,
                                    window=window, seqused_k=torch.tensor(used))
    rows = torch.cat([torch.arange(s, s + u) for s, u in zip(cu_k.tolist(), used)] +
                     [torch.zeros(0, dtype=torch.long)])
    ref_out, ref_lse = _dense_varlen(q, k[rows], v[rows], lens_q, used, 0.25, causal, window)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if len(out):
        assert (out.double() - ref_out).abs().max().item() <= TOL[dtype]
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out[empty] == 0).all()
    if (~empty).any():
        assert (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() <= TOL[dtype] * 10


def test_varlen_seqused_k_out_of_range_is_rejected():
    q, k = torch.randn(4, 2, 8), torch.randn(7, 2, 8)
    cu_q, cu_k = torch.tensor([0, 2, 4]), torch.tensor([0, 4, 7])
    for used in ([5, 1], [-1, 1]):
        with pytest.raises(ValueError, match="seqused_k"):
            OPS.varlen_attention(q, k, k, cu_q, cu_k, scale=0.3, causal=True,
                                 seqused_k=torch.tensor(used))
    with pytest.raises(ValueError, match="seqused_k"):  # one count per request
        OPS.varlen_attention(q, k, k, cu_q, cu_k, scale=0.3, causal=True,
                             seqused_k=torch.tensor([1]))
