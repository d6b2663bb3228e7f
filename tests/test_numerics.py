"""Numerics of the CP paths: error vs float64 no worse than 1.5x the single-device error of the
same dtype on the same workload (short mixed batches, peaked softmax, a 64k-token context),
exact and NaN-free LSE merges, bit-identical outputs run to run.
"""
from __future__ import annotations

import pytest
import torch

from cp_attention.config import CPConfig
from cp_attention.ops import merge_attn_states, merge_many
from cp_attention.testing.workload import Workload, run_workload

from numerics_tasks import run_checked

RATIO = 1.5
DTYPES = ("float32", "bfloat16", "float16")
CONFIGS = {
    "pcp2xdcp2": CPConfig(pcp_size=2, tp_size=2, dcp_size=2),
    "pcp4_interleave4": CPConfig(pcp_size=4, cp_kv_interleave_size=4),
}
# prefills, decodes, a chunked prefill over the same cache, a mixed batch
STEPS = (((0, 70), (1, 33)), ((0, 1), (1, 1)), ((0, 1), (1, 40), (2, 17)),
         ((0, 1), (1, 1), (2, 1)))
LONG = 65536  # tokens of the long-context request, prefilled in two chunks of 32k
LONG_STEPS = (((0, LONG // 2),), ((0, LONG // 2),), ((0, 1),), ((0, 1),))
WORST: dict[str, float] = {}


def workload(config: CPConfig, dtype: str, logit_scale: float = 1.0, steps=STEPS,
             num_heads: int = 4, seed: int = 3) -> Workload:
    return Workload(config, steps, num_heads=num_heads, num_kv_heads=1, head_size=32,
                    dtype=dtype, logit_scale=logit_scale, seed=seed)


def single(w: Workload) -> Workload:
    """The same workload (same tokens: they depend on seed and shapes only) on one device."""
    return Workload(CPConfig(block_size=w.config.block_size), w.steps, w.num_heads,
                    w.num_kv_heads, w.head_size, w.dtype, w.sliding_window, w.encoder_only,
                    w.logit_scale, w.seed)


def check_ratio(name: str, cp_err: float, single_err: float) -> None:
    ratio = cp_err / single_err
    WORST[name] = max(WORST.get(name, 0.0), ratio)
    print(f"{name}: cp {cp_err:.3e} single {single_err:.3e} ratio {ratio:.3f}")
    assert single_err > 0
    assert cp_err <= RATIO * single_err, f"{name}: CP error {cp_err:.3e} > {RATIO} x {single_err:.3e}"


@pytest.mark.distributed
@pytest.mark.parametrize("logit_scale", [1.0, 30.0], ids=["plain", "peaked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_cp_error_within_ratio_of_single_device(pools, config_name, dtype, logit_scale) -> None:
    w = workload(CONFIGS[config_name], dtype, logit_scale)
    reports = pools(4).run("cp_attention.testing.workload.run_workload_task", w)
    base = run_workload(single(w))
    assert not base.any_nan and not any(r.any_nan for r in reports)
    assert all(r.cache_exact for r in reports)
    check_ratio(f"{dtype}", max(r.max_err for r in reports), base.max_err)


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_64k(pools, dtype) -> None:
    """One 64k-token request (two 32k chunks, then decodes); the oracle checks 32 sampled rows
    per request and step on every rank (a full fp64 oracle of 64k x 64k does not fit)."""
    w = workload(CONFIGS["pcp2xdcp2"], dtype, steps=LONG_STEPS, num_heads=2)
    results = pools(4).run("numerics_tasks.run_checked_task", w, 32, timeout_s=300)
    base = run_checked(single(w), rows_per_req=32)
    assert not base["any_nan"] and not any(r["any_nan"] for r in results)
    check_ratio(f"{dtype}", max(r["max_err"] for r in results), base["max_err"])


@pytest.mark.distributed
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_cp_outputs_are_bit_identical_run_to_run(pools, config_name) -> None:
    w = workload(CONFIGS[config_name], "bfloat16", seed=5)
    first = pools(4).run("numerics_tasks.run_checked_task", w, None, True)
    second = pools(4).run("numerics_tasks.run_checked_task", w, None, True)
    for rank, (a, b) in enumerate(zip(first, second)):
        assert len(a["outputs"]) == len(STEPS)
        for step, (out_a, out_b) in enumerate(zip(a["outputs"], b["outputs"])):
            assert torch.equal(out_a.view(torch.int16), out_b.view(torch.int16)), (rank, step)


# -- merges -----------------------------------------------------------------------------------
def _parts(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(5, 3, 8, generator=gen, dtype=torch.float64).to(dtype)
    lse = (torch.randn(5, 3, generator=gen, dtype=torch.float64) * 20).to(dtype)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_with_an_empty_part_is_exact(dtype) -> None:
    out, lse = _parts(dtype)
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    for merged, merged_lse in (merge_attn_states(out, lse, empty_out, empty_lse),
                               merge_attn_states(empty_out, empty_lse, out, lse)):
        assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    m, l = merge_many(torch.stack([empty_out, out, empty_out]), torch.stack([empty_lse, lse, empty_lse]))
    assert torch.equal(m, out) and torch.equal(l, lse)


def test_merge_both_empty_and_extreme_lse_never_nan() -> None:
    out, lse = _parts()
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    m, l = merge_attn_states(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(m, empty_out) and bool(torch.isneginf(l).all())
    for big in (1e4, 3e38):  # exp() would overflow without the max-shift
        m, l = merge_attn_states(out, lse + big, out * 2, lse - big)
        assert not bool(torch.isnan(m).any()) and not bool(torch.isnan(l).any())
        torch.testing.assert_close(m, out)  # the -big part has weight exp(-2 big) = 0
        torch.testing.assert_close(l, lse + big)


def test_merge_matches_float64_concatenation() -> None:
    """Two halves of one key set merge to the attention over all keys (vs float64)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    scores = torch.einsum("qhd,khd->qhk", q, k) * 4.0  # peaked

    def attend(sel):
        s = scores[:, :, sel]
        lse = torch.logsumexp(s, dim=-1)
        return torch.einsum("qhk,khd->qhd", torch.exp(s - lse[..., None]), v[sel]), lse

    full_out, full_lse = attend(slice(0, 6))
    (oa, la), (ob, lb) = attend(slice(0, 2)), attend(slice(2, 6))
    m, l = merge_attn_states(oa.float(), la.float(), ob.float(), lb.float())
    assert (m.double() - full_out).abs().max() < 1e-6
    assert (l.double() - full_lse).abs().max() < 1e-5
