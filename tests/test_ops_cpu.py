"""The C++ CPU ops (CpuOps) against the float64 oracle and ReferenceOps.

K/V/q are drawn in the tested dtype and the oracle reads the same (exactly representable)
values in float64, so every dtype is held to float32 rounding error: the kernels accumulate
in float32 and never round the cache.
"""
from __future__ import annotations

import math
import os
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_leaves

from cp_attention.ops import CpuOps, ReferenceOps, get_ops
from cp_attention.ops.cpu_build import STALE_LOCK_S, clear_stale_lock, load_cpu_extension
from cp_attention.testing.dense import dense_attention

OUT_TOL = 3e-5
LSE_TOL = 3e-5


@pytest.fixture(scope="module")
def ops(cpu_ops) -> CpuOps:
    return cpu_ops


class Threads:
    """Context manager: torch.set_num_threads(n), restored on exit."""

    def __init__(self, n: int):
        self.n, self.saved = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def make_cache(num_blocks, block_size, hkv, d, dtype, strided, gen):
    """K/V caches [num_blocks, block_size, hkv, d]; strided: views of vLLM's CPU layout."""
    if strided:  # [blocks, heads, slots, 2 * D] viewed the way the vLLM plugin does
        packed = torch.randn(num_blocks, hkv, block_size, 2 * d, generator=gen).to(dtype)
        kv = packed.unflatten(-1, (2, d)).permute(3, 0, 2, 1, 4)
        assert not kv[0].is_contiguous()
        return kv[0], kv[1]
    return (torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype),
            torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype))


def paged_case(seq_lens, q_lens, block_size, hkv, group, d, dtype, strided, table_dtype, gen):
    """Random paged problem; returns (args, per-request contiguous K/V)."""
    blocks_per_req = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=table_dtype)
    kc, vc = make_cache(num_blocks, block_size, hkv, d, dtype, strided, gen)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(dtype)
    keys, values, start = [], [], 0
    for r, nb in enumerate(blocks_per_req):
        table[r, :nb] = perm[start:start + nb].to(table_dtype)
        start += nb
        ids = table[r, :nb].long()
        keys.append(kc[ids].flatten(0, 1)[:seq_lens[r]])
        values.append(vc[ids].flatten(0, 1)[:seq_lens[r]])
    cu_q = torch.tensor([0] + list(q_lens)).cumsum(0).to(table_dtype)
    return (q, kc, vc, table, cu_q, torch.tensor(seq_lens, dtype=table_dtype)), keys, values


def check_against_oracle(out, lse, q, keys, values, q_lens, seq_lens, scale, kv_start, kv_end):
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    qs = 0
    for r, nq in enumerate(q_lens):
        for i in range(qs, qs + nq):
            lo, hi = 0, seq_lens[r]
            if kv_start is not None:
                lo = min(max(int(kv_start[i]), 0), hi)
            if kv_end is not None:
                hi = min(max(int(kv_end[i]), 0), hi)
            if hi <= lo:
                assert (out[i] == 0).all() and torch.isneginf(lse[i]).all(), f"row {i} not empty"
                continue
            ref, ref_lse = dense_attention(q[i:i + 1], keys[r][lo:hi], values[r][lo:hi],
                                           torch.tensor([hi - lo]), scale, causal=False)
            assert (out[i:i + 1].double() - ref).abs().max().item() <= OUT_TOL, f"row {i}"
            assert (lse[i:i + 1].double() - ref_lse).abs().max().item() <= LSE_TOL, f"row {i}"
        qs += nq


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seq_lens=st.lists(st.sampled_from([0, 1, 15, 16, 17, 127, 128, 129, 300]) |
                         st.integers(0, 400), min_size=1, max_size=4),
       q_lens=st.lists(st.integers(0, 4), min_size=4, max_size=4),
       block_size=st.sampled_from([16, 128]), group=st.sampled_from([1, 4, 8]),
       hkv=st.sampled_from([1, 2]), d=st.sampled_from([64, 80, 128, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       ranged=st.sampled_from([None, "start", "end", "both"]), strided=st.booleans(),
       table_dtype=st.sampled_from([torch.int32, torch.int64]), threads=st.sampled_from([1, 2]))
def test_paged_attention_matches_oracle(ops, seq_lens, q_lens, block_size, group, hkv, d, dtype,
                                        ranged, strided, table_dtype, threads):
    q_lens = q_lens[:len(seq_lens)]
    gen = torch.Generator().manual_seed(sum(seq_lens) + 31 * sum(q_lens) + d + group)
    args, keys, values = paged_case(seq_lens, q_lens, block_size, hkv, group, d, dtype, strided,
                                    table_dtype, gen)
    num_q = sum(q_lens)
    kv_start = kv_end = None
    if ranged in ("start", "both"):  # beyond seq_len and negative values are clipped
        kv_start = torch.randint(-5, 300, (num_q,), generator=gen).to(table_dtype)
    if ranged in ("end", "both"):
        kv_end = torch.randint(-5, 450, (num_q,), generator=gen).to(table_dtype)
    scale = 1 / math.sqrt(d)
    with Threads(threads):
        out, lse = ops.paged_attention(*args, scale=scale, kv_start=kv_start, kv_end=kv_end)
    check_against_oracle(out, lse, args[0], keys, values, q_lens, seq_lens, scale, kv_start,
                         kv_end)
    ref_out, ref_lse = ReferenceOps().paged_attention(*args, scale=scale, kv_start=kv_start,
                                                      kv_end=kv_end)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert (out - ref_out).abs().max().item() <= 2 * OUT_TOL if out.numel() else True


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_split_over_threads(ops, threads, dtype):
    """Flash-decoding: long contexts are cut into key ranges merged by LSE; rows whose range
    misses some of those pieces (or all) still come out exact."""
    seq_lens, q_lens = [6000, 2500, 0, 40], [3, 1, 2, 2]
    gen = torch.Generator().manual_seed(7)
    args, keys, values = paged_case(seq_lens, q_lens, 128, 2, 4, 64, dtype, True, torch.int32,
                                    gen)
    kv_start = torch.tensor([0, 5000, 5990, 100, 0, 0, 39, 0])
    kv_end = torch.tensor([6000, 5600, 9999, 2400, 5, 5, 40, 0])
    with Threads(threads):
        out, lse = ops.paged_attention(*args, scale=0.125, kv_start=kv_start, kv_end=kv_end)
        full_out, full_lse = ops.paged_attention(*args, scale=0.125)
    check_against_oracle(out, lse, args[0], keys, values, q_lens, seq_lens, 0.125, kv_start,
                         kv_end)
    check_against_oracle(full_out, full_lse, args[0], keys, values, q_lens, seq_lens, 0.125,
                         None, None)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("hkv,group,q_len", [(3, 4, 1), (5, 1, 64), (8, 4, 16), (6, 3, 30),
                                           (8, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interleaved_heads_cache(ops, threads, hkv, group, q_len, dtype):
    """The [blocks, block_size, Hkv, D] cache (heads interleaved in a slot) is read several
    KV heads per work item: item head counts that do not divide Hkv (5 heads as 4 + 1, 6 as
    4 + 2), lane groups of 1-4 rows (16-bit K/V widened in place) and of 8 (staged), items of
    one row per KV head (MHA decode: the next tile prefetched head by head), key ranges split
    over threads and partial ranges, each against the float64 oracle."""
    gen = torch.Generator().manual_seed(hkv * 1000 + group * 10 + q_len)
    seq_lens, q_lens = [1500, 0, 37, 300], [q_len, 1, 2, q_len]
    args, keys, values = paged_case(seq_lens, q_lens, 32, hkv, group, 64, dtype, False,
                                    torch.int32, gen)
    assert args[1].stride(2) < args[1].stride(1)  # heads interleaved inside a slot
    num_q = sum(q_lens)
    kv_start = torch.randint(-5, 200, (num_q,), generator=gen)
    kv_end = torch.randint(100, 1600, (num_q,), generator=gen)
    with Threads(threads):
        for ranges in [(None, None), (kv_start, kv_end)]:
            out, lse = ops.paged_attention(*args, scale=0.125, kv_start=ranges[0],
                                           kv_end=ranges[1])
            check_against_oracle(out, lse, args[0], keys, values, q_lens, seq_lens, 0.125,
                                 *ranges)


@pytest.mark.parametrize("group", [2, 3, 5, 11])
@pytest.mark.parametrize("d", [12, 32, 72])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_and_key_remainders(ops, group, d, dtype):
    """Lane groups of 1 to 7 rows (the dot-product score kernel takes those of up to 4), head
    sizes that are not a multiple of 8 lanes (and D=32: bf16 dot products where the CPU has
    avx512_bf16), and key counts that are not a multiple of the score kernels' key blocks,
    with ranges cutting tiles."""
    gen = torch.Generator().manual_seed(group * 100 + d)
    seq_lens, q_lens = [0, 1, 37, 300], [1, 2, 3, 1]
    args, keys, values = paged_case(seq_lens, q_lens, 16, 2, group, d, dtype, True,
                                    torch.int32, gen)
    kv_start = torch.tensor([0, 0, 0, 3, 5, 9, 0])
    kv_end = torch.tensor([1, 1, 1, 30, 36, 37, 299])
    for ranges in [(None, None), (kv_start, kv_end)]:
        out, lse = ops.paged_attention(*args, scale=0.2, kv_start=ranges[0], kv_end=ranges[1])
        check_against_oracle(out, lse, args[0], keys, values, q_lens, seq_lens, 0.2, *ranges)


@pytest.mark.parametrize("threads", [1, 2])
def test_calls_of_other_shapes_in_between_change_nothing(ops, threads):
    """Each worker thread keeps its scratch buffers between calls (grown, never cleared): a
    call after larger and smaller ones (other head sizes, groups, dtypes, ranges) gives the
    same bits as the first time, and the oracle's result."""
    gen = torch.Generator().manual_seed(7)
    cases = [paged_case([300, 37], [3, 1], 16, 2, group, d, dtype, True, torch.int32, gen)
             for group, d, dtype in [(4, 64, torch.float32), (11, 256, torch.bfloat16),
                                     (1, 12, torch.float32), (3, 128, torch.float16)]]
    ranges = (torch.tensor([0, 5, 9, 0]), torch.tensor([300, 36, 37, 30]))
    with Threads(threads):
        first = ops.paged_attention(*cases[0][0], scale=0.2, kv_start=ranges[0],
                                    kv_end=ranges[1])
        for args, _, _ in cases[1:] + cases[:1] + cases[1:]:
            ops.paged_attention(*args, scale=0.2)
        again = ops.paged_attention(*cases[0][0], scale=0.2, kv_start=ranges[0],
                                    kv_end=ranges[1])
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    check_against_oracle(*again, cases[0][0][0], *cases[0][1:], [3, 1], [300, 37], 0.2,
                         *ranges)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_float32_queries_on_a_bf16_cache(ops, group):
    """float32 queries over a bf16 cache take the widening path on every CPU (the bf16 dot
    products need bf16 queries): same oracle."""
    gen = torch.Generator().manual_seed(group)
    seq_lens, q_lens = [45, 300], [1, 3]
    args, keys, values = paged_case(seq_lens, q_lens, 16, 2, group, 64, torch.bfloat16, False,
                                    torch.int32, gen)
    q = torch.randn(args[0].shape, generator=gen)
    out, lse = ops.paged_attention(q, *args[1:], scale=0.125)
    check_against_oracle(out, lse, q, keys, values, q_lens, seq_lens, 0.125, None, None)


def test_speculative_decode_rows_with_causal_offsets(ops):
    """Several queries per request, each with its own end (spec decode / chunked context)."""
    gen = torch.Generator().manual_seed(3)
    seq_lens, q_lens = [37, 200], [4, 70]
    args, keys, values = paged_case(seq_lens, q_lens, 16, 2, 8, 128, torch.bfloat16, False,
                                    torch.int64, gen)
    kv_end = torch.cat([torch.arange(34, 38), torch.arange(131, 201)])
    out, lse = ops.paged_attention(*args, scale=0.1, kv_end=kv_end)
    check_against_oracle(out, lse, args[0], keys, values, q_lens, seq_lens, 0.1, None, kv_end)


def test_index_tensors_of_any_integer_dtype_and_stride(ops):
    """cu_seqlens_q, seq_lens, kv_start and kv_end are read in place when 1-D int32/int64
    (strided views included) and converted otherwise: every form gives the same result."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, q_lens = [37, 200, 129], [2, 3, 1]
    args, keys, values = paged_case(seq_lens, q_lens, 16, 2, 3, 64, torch.float32, False,
                                    torch.int64, gen)
    q, kc, vc, table, cu_q, lens = args
    kv_start = torch.tensor([0, 5, 0, 10, 90, 3])
    kv_end = torch.tensor([36, 37, 150, 199, 200, 129])
    expected = ops.paged_attention(*args, scale=0.3, kv_start=kv_start, kv_end=kv_end)
    check_against_oracle(*expected, q, keys, values, q_lens, seq_lens, 0.3, kv_start, kv_end)

    def strided(x, dtype):  # every other element of a longer tensor: stride 2
        return torch.stack([x, torch.full_like(x, -7)], dim=1).to(dtype)[:, 0]

    for form in (lambda x: x.to(torch.int32), lambda x: strided(x, torch.int32),
                 lambda x: strided(x, torch.int64), lambda x: x.to(torch.int16),
                 lambda x: x.view(-1, 1)):
        out, lse = ops.paged_attention(q, kc, vc, table, form(cu_q), form(lens), scale=0.3,
                                       kv_start=form(kv_start), kv_end=form(kv_end))
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


def test_empty_inputs(ops):
    gen = torch.Generator().manual_seed(1)
    args, _, _ = paged_case([0, 0], [0, 0], 16, 1, 4, 64, torch.float32, False, torch.int32, gen)
    out, lse = ops.paged_attention(*args, scale=1.0)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    args, _, _ = paged_case([0, 5], [3, 0], 16, 1, 4, 64, torch.float32, False, torch.int32, gen)
    out, lse = ops.paged_attention(*args, scale=1.0)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_paged_attention_rejects_bad_arguments(ops):
    gen = torch.Generator().manual_seed(2)
    (q, kc, vc, table, cu, lens), _, _ = paged_case([20], [1], 16, 2, 2, 64, torch.float32,
                                                    False, torch.int32, gen)
    with pytest.raises(ValueError, match="multiple of key_cache heads"):
        ops.paged_attention(q[:, :3], kc, vc, table, cu, lens, scale=1.0)
    with pytest.raises(ValueError, match="head_size of q"):
        ops.paged_attention(q[..., :32], kc, vc, table, cu, lens, scale=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        ops.paged_attention(q, kc, vc, table, cu, lens + 100, scale=1.0)
    with pytest.raises(IndexError, match="block id outside"):
        ops.paged_attention(q, kc, vc, table + 1000, cu, lens, scale=1.0)


def _step_rows(key: torch.Tensor, value: torch.Tensor, layout: str):
    """The same [T, Hkv, D] rows as contiguous tensors, as the two halves of one
    [T, 2, Hkv, D] tensor (the PCP restored step K/V), or with a non-contiguous head_size."""
    if layout == "kv_pair":
        pair = torch.stack([key, value], dim=1)
        return pair[:, 0], pair[:, 1]
    if layout == "head_size_strided":
        return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (key, value))
    return key, value


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("src_layout", ["contiguous", "kv_pair", "head_size_strided"])
@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32),
                                                   (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float16),
                                                   (torch.float64, torch.float64)])
def test_reshape_and_cache_matches_reference(ops, strided, src_layout, src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(4)
    hkv, d, block_size, num_blocks = 2, 80, 16, 5
    key = torch.randn(30, hkv, d, generator=gen).to(src_dtype)
    value = torch.randn(30, hkv, d, generator=gen).to(src_dtype)
    key, value = _step_rows(key, value, src_layout)
    assert (key.is_contiguous(), key.stride(-1) == 1) == {
        "contiguous": (True, True), "kv_pair": (False, True),
        "head_size_strided": (False, False)}[src_layout]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:30]
    slots[::4] = -1
    caches = [make_cache(num_blocks, block_size, hkv, d, cache_dtype, strided, gen)
              for _ in range(2)]
    ref_k, ref_v = caches[1][0].clone(), caches[1][1].clone()
    before = caches[0][0].clone()
    ops.reshape_and_cache(key, value, caches[0][0], caches[0][1], slots.int())
    ReferenceOps().reshape_and_cache(key, value, ref_k, ref_v, slots)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = caches[0][0].reshape(-1, hkv, d)
    assert torch.equal(flat[written], ref_k.reshape(-1, hkv, d)[written])
    assert torch.equal(caches[0][1].reshape(-1, hkv, d)[written],
                       ref_v.reshape(-1, hkv, d)[written])
    assert torch.equal(flat[~written], before.reshape(-1, hkv, d)[~written])  # untouched
    with pytest.raises(IndexError, match="slot_mapping holds a slot outside"):
        ops.reshape_and_cache(key, value, caches[0][0], caches[0][1], slots + 1000)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cache_and_paged_attention_is_the_write_then_the_read(ops, strided, dtype):
    """The fused decode call writes what reshape_and_cache writes and then attends the written
    cache: the new rows (two per request, spec decode) attend themselves causally; against
    the float64 oracle (float64 inputs: against the reference ops, which they run on)."""
    gen = torch.Generator().manual_seed(6)
    seq_lens, q_lens = [19, 140], [2, 2]
    args, _, _ = paged_case(seq_lens, q_lens, 16, 2, 4, 64, dtype, strided, torch.int64, gen)
    q, kc, vc, table, cu, lens = args
    key = torch.randn(4, 2, 64, generator=gen).to(dtype)
    value = torch.randn(4, 2, 64, generator=gen).to(dtype)
    pos = torch.tensor([17, 18, 138, 139])  # the last two positions of each request
    slots = table[torch.tensor([0, 0, 1, 1]), pos // 16] * 16 + pos % 16
    kv_end = pos + 1
    fused_k, fused_v = kc.clone(), vc.clone()
    out, lse = ops.cache_and_paged_attention(q, key, value, fused_k, fused_v, slots, table, cu,
                                             lens, scale=0.3, kv_end=kv_end)
    ReferenceOps().reshape_and_cache(key, value, kc, vc, slots)
    ref_out, ref_lse = ReferenceOps().paged_attention(q, kc, vc, table, cu, lens, scale=0.3,
                                                      kv_end=kv_end)
    assert torch.equal(fused_k, kc) and torch.equal(fused_v, vc)
    if dtype == torch.float64:
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
        return
    keys = [kc[table[r].long()].flatten(0, 1)[:n] for r, n in enumerate(seq_lens)]
    values = [vc[table[r].long()].flatten(0, 1)[:n] for r, n in enumerate(seq_lens)]
    check_against_oracle(out, lse, q, keys, values, q_lens, seq_lens, 0.3, None, kv_end)


def test_float64_goes_to_the_reference(ops):
    gen = torch.Generator().manual_seed(6)
    args, keys, values = paged_case([50], [2], 16, 1, 4, 64, torch.float64, False, torch.int64,
                                    gen)
    out, lse = ops.paged_attention(*args, scale=0.2)
    assert out.dtype == torch.float64
    ref, ref_lse = dense_attention(args[0], keys[0], values[0], torch.full((2,), 49), 0.2,
                                   causal=False)
    assert (out - ref).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12


def test_varlen_matches_reference(ops):
    """Whichever route varlen takes (C++ kernel once merged, reference until then)."""
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(12, 4, 64, generator=gen), torch.randn(20, 2, 64, generator=gen)
    cu_q, cu_k = torch.tensor([0, 5, 5, 12]), torch.tensor([0, 9, 11, 20])
    for causal, window in ((False, None), (True, None), (True, 3)):
        out, lse = ops.varlen_attention(q, k, k, cu_q, cu_k, scale=0.2, causal=causal,
                                        window=window)
        ref, ref_lse = ReferenceOps().varlen_attention(q, k, k, cu_q, cu_k, scale=0.2,
                                                       causal=causal, window=window)
        assert (out - ref).abs().max() <= OUT_TOL
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


def test_forced_reference_env(monkeypatch):
    monkeypatch.setenv("CP_ATTENTION_OPS", "reference")
    load_cpu_extension.cache_clear()
    try:
        assert isinstance(get_ops("cpu"), ReferenceOps)
    finally:
        monkeypatch.delenv("CP_ATTENTION_OPS")
        load_cpu_extension.cache_clear()
    assert get_ops("cpu", "reference").name == "reference"


def test_stale_build_lock_is_removed_fresh_one_kept(tmp_path, monkeypatch):
    """A lock left by a build killed long ago would block every later start: removed (with a
    warning); a lock younger than STALE_LOCK_S belongs to a live build: kept."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cp_attention_cpu_test" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert not clear_stale_lock("cp_attention_cpu_test") and lock.exists()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        assert clear_stale_lock("cp_attention_cpu_test")
    assert not lock.exists()
    assert not clear_stale_lock("cp_attention_cpu_test")  # nothing left to remove


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 40), heads=st.integers(1, 6), d=st.sampled_from([1, 8, 64, 80]),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_merge_attn_states_matches_torch_merge(ops, tokens, heads, d, strided, seed):
    """The C++ merge against the torch merge (the oracle's): random partials with empty
    parts (lse -inf) on one side, on both sides, and strided (non-contiguous) inputs."""
    gen = torch.Generator().manual_seed(seed)

    def part():
        out = torch.randn(tokens, heads, d, generator=gen)
        lse = torch.randn(tokens, heads, generator=gen) * 5
        lse[torch.rand(tokens, heads, generator=gen) < 0.3] = -math.inf
        if strided:  # [T, H, D] views of a [H, T, D] buffer, lse of a [H, T] buffer
            out, lse = out.transpose(0, 1).contiguous().transpose(0, 1), lse.t().contiguous().t()
        return out, lse

    (out_a, lse_a), (out_b, lse_b) = part(), part()
    out, lse = ops.merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = ReferenceOps().merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.allclose(out, ref_out, atol=1e-6, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-6, rtol=1e-6)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[torch.isneginf(lse)] == 0).all()


def test_merge_attn_states_other_dtypes_use_the_torch_merge(ops):
    """float64 (the oracle's precision) and bf16 partials are merged by the torch merge."""
    for dtype in (torch.float64, torch.bfloat16):
        out_a, out_b = torch.randn(3, 2, 8, dtype=dtype), torch.randn(3, 2, 8, dtype=dtype)
        lse_a, lse_b = torch.randn(3, 2, dtype=dtype), torch.randn(3, 2, dtype=dtype)
        out, _ = ops.merge_attn_states(out_a, lse_a, out_b, lse_b)
        ref, _ = ReferenceOps().merge_attn_states(out_a, lse_a, out_b, lse_b)
        assert out.dtype == dtype and torch.equal(out, ref)


def _op_samples(gen: torch.Generator) -> dict[str, tuple]:
    """Small arguments of each torch.ops.cp_attention op (2 requests, GQA 2, D 16)."""
    q = torch.randn(3, 4, 16, generator=gen)
    kc, vc = torch.randn(2, 4, 8, 2, 16, generator=gen).unbind(0)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    cu, lens = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([5, 12], dtype=torch.int32)
    key, value = torch.randn(2, 3, 2, 16, generator=gen).unbind(0)
    slots = torch.tensor([4, -1, 30])
    part = (torch.randn(3, 4, 16, generator=gen), torch.randn(3, 4, generator=gen))
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    k, v = torch.randn(2, 12, 2, 16, generator=gen).unbind(0)
    return {
        "paged_attention": (q, kc, vc, table, cu, lens, 0.25, None, torch.tensor([3, 9, 12])),
        "merge_attn_states": (*part, part[0] * 2, part[1] - 1),
        "reshape_and_cache": (key, value, kc.clone(), vc.clone(), slots),
        "cache_and_paged_attention": (q, key, value, kc.clone(), vc.clone(), slots, table, cu,
                                      lens, 0.25, None, None),
        "varlen_attention": (q, k, v, cu, cu_k, 0.25, True, 0, torch.tensor([4, 7])),
    }


@pytest.mark.parametrize("name", ["paged_attention", "merge_attn_states", "reshape_and_cache",
                                  "cache_and_paged_attention", "varlen_attention"])
def test_ops_are_registered_and_trace(ops, name):
    """Each kernel is a torch operator with a schema and a Meta kernel: opcheck (schema,
    fake tensors, AOT dispatch with dynamic shapes) passes, and make_fx traces a call into one
    graph node whose output shapes match the real call's."""
    op = getattr(torch.ops.cp_attention, name)
    args = _op_samples(torch.Generator().manual_seed(4))[name]
    torch.library.opcheck(op, args)
    graph = make_fx(lambda *a: op(*a), tracing_mode="symbolic")(*args)
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"
            and "cp_attention" in str(n.target)] == [op.default]
    assert [t.shape for t in tree_leaves(graph(*args)) if t is not None] == \
        [t.shape for t in tree_leaves(op(*args)) if t is not None]


def test_cpu_ops_compile_fullgraph(ops):
    """CpuOps' calls trace as one graph under torch.compile (no graph break at the kernels)."""
    q, kc, vc, table, cu, lens, _, _, kv_end = _op_samples(
        torch.Generator().manual_seed(5))["paged_attention"]

    def layer(q):
        out, lse = ops.paged_attention(q, kc, vc, table, cu, lens, scale=0.25, kv_end=kv_end)
        return ops.merge_attn_states(out, lse, out, lse)

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    for got, want in zip(compiled(q), layer(q)):
        torch.testing.assert_close(got, want)
