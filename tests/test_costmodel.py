"""Cost model: hand-computed values, monotonicity, recommendations."""
from __future__ import annotations

import re

import pytest

from cp_attention import costmodel

SMALL = costmodel.ModelShape(num_layers=1, num_heads=8, num_kv_heads=2, head_size=32, dtype_bytes=4)
UNIT = costmodel.Device("unit", flops=1.0, hbm_bw=1.0, hbm_bytes=1e18, link_bw=1.0,
                 link_latency_s=0.0, efficiency=1.0)


def test_prefill_bytes_hand_computed():
    # c = ceil(1000 / 8) = 125; 2c rows x (K,V) x 2 kv heads x 32 x 4 B x (pcp - 1)
    assert costmodel.prefill_comm_bytes(SMALL, 1000, pcp=4) == 250 * 2 * 2 * 32 * 4 * 3 == 384000
    assert costmodel.prefill_comm_lower_bound(SMALL, 1000, pcp=4) == pytest.approx(384000)
    assert costmodel.prefill_comm_bytes(SMALL, 1000, pcp=1) == 0
    # tp=4 holds 2 // 4 -> 1 replicated KV head
    assert costmodel.prefill_comm_bytes(SMALL, 1000, pcp=2, tp=4) == 500 * 2 * 1 * 32 * 4 * 1


def test_prefill_bytes_at_least_bound_and_tight():
    for pcp in (2, 3, 4, 8):
        for prompt in (1, 7, 1000, 4097, 65536):
            sent = costmodel.prefill_comm_bytes(SMALL, prompt, pcp)
            bound = costmodel.prefill_comm_lower_bound(SMALL, prompt, pcp)
            assert sent >= bound - 1e-9
            assert sent <= bound * (1 + 2 * pcp / prompt) + 1e-9  # only padding on top
    assert (costmodel.prefill_comm_bytes(SMALL, 4096, 4)
            == costmodel.prefill_comm_lower_bound(SMALL, 4096, 4))


def test_decode_bytes_hand_computed():
    one_kv = costmodel.ModelShape(1, 8, 1, 32, 4)
    # tp=2: 4 q heads/rank. dcp=2: Q gather 2*4*32*4 = 1024, LSE gather 2*2*4*4 = 64,
    # reduce-scatter 2*2*4*32*4 / 2 = 1024; pcp=2 all-to-all 2*2*4*33*4 / 2 = 1056
    assert (costmodel.decode_comm_bytes(one_kv, batch=2, pcp=2, tp=2, dcp=2)
            == 1024 + 64 + 1024 + 1056)
    assert costmodel.decode_comm_bytes(one_kv, batch=2, pcp=1, tp=4, dcp=2) == 512 + 32 + 512
    assert costmodel.decode_comm_bytes(one_kv, batch=2, pcp=1, tp=4, dcp=1) == 0
    assert costmodel.decode_collectives(1, 1) == 0 and costmodel.decode_collectives(2, 4) == 4


def test_prefill_estimate_hand_computed():
    unit = costmodel.ModelShape(1, 1, 1, 1, 1)
    one = costmodel.prefill_estimate(unit, UNIT, 4, pcp=1)
    assert one.compute_s == 4 * (4 * 5 // 2) and one.comm_s == 0  # 4 FLOPs x L(L+1)/2 pairs
    two = costmodel.prefill_estimate(unit, UNIT, 8, pcp=2)
    # c = 2: pairs = 2*2*2*2 + 2 = 18 -> 72 FLOPs; all-gather 4 rows x 2 x 1 B x 1 = 8 B
    assert two.compute_s == 72 and two.comm_s == 8 and two.comm_bytes_per_layer == 8
    assert two.total_s == 80


def test_collective_seconds():
    dev = costmodel.Device("d", 1, 1, 1, link_bw=1e9, link_latency_s=1e-5)
    assert costmodel.collective_seconds(dev, 1, 1e9) == 0.0
    assert costmodel.collective_seconds(dev, 4, 3e6) == pytest.approx(3e-5 + 3e-3)


@pytest.mark.parametrize("device", ["h100-sxm", "h200-sxm", "ascend-910b"])
def test_prefill_monotone(device):
    dev, model = costmodel.PRESETS[device], costmodel.MODELS["llama3-70b"]
    prompts = (131072, 262144, 524288, 1048576)
    for pcp in (2, 4, 8):
        effs = [costmodel.prefill_efficiency(model, dev, p, pcp, tp=8) for p in prompts]
        assert all(0 < e <= 1 for e in effs)
        assert effs == sorted(effs)  # longer prompts amortize the K/V all-gather better
    for p in prompts:
        est = [costmodel.prefill_estimate(model, dev, p, pcp, tp=8) for pcp in (1, 2, 4, 8)]
        assert [e.compute_s for e in est] == sorted((e.compute_s for e in est), reverse=True)
        assert [e.comm_s for e in est] == sorted(e.comm_s for e in est)
        assert [e.total_s for e in est] == sorted((e.total_s for e in est), reverse=True)
        assert [e.kv_bytes_per_rank for e in est] == sorted(
            (e.kv_bytes_per_rank for e in est), reverse=True)


def test_decode_comm_flat_in_context_and_attention_shrinks():
    model, dev = costmodel.MODELS["mla-671b"], costmodel.PRESETS["h100-sxm"]
    short = costmodel.decode_estimate(model, dev, 1024, 1, pcp=2, tp=8, dcp=8)
    long = costmodel.decode_estimate(model, dev, 1 << 20, 1, pcp=2, tp=8, dcp=8)
    assert short.comm_s == long.comm_s and short.comm_bytes_per_layer == long.comm_bytes_per_layer
    assert long.compute_s > short.compute_s
    times = [costmodel.decode_estimate(model, dev, 1 << 20, 1, pcp=1, tp=8, dcp=d).compute_s
             for d in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)


def test_cores_cap_slows_compute():
    cpu = costmodel.PRESETS["cpu-gloo-this-machine"]
    model = costmodel.ModelShape(1, 4, 4, 64, 4)
    one = costmodel.prefill_estimate(model, cpu, 8192, pcp=1)
    four = costmodel.prefill_estimate(model, cpu, 8192, pcp=4)  # 4 ranks on 2 cores
    assert four.compute_s > one.compute_s / 4 * 1.9


def test_valid_dcp():
    assert costmodel.valid_dcp(costmodel.MODELS["llama3-70b"], 8) == [1]
    assert costmodel.valid_dcp(costmodel.MODELS["mla-671b"], 8) == [1, 2, 4, 8]
    assert costmodel.valid_dcp(costmodel.ModelShape(1, 8, 1, 32), 4) == [1, 2, 4]


def test_recommend():
    model, dev = costmodel.MODELS["llama3-70b"], costmodel.PRESETS["h100-sxm"]
    long = costmodel.recommend(model, dev, costmodel.Mix(prompt=1 << 20, decode_steps=256), tp=8)
    assert long.fits and long.pcp >= 2  # 1M tokens of KV do not fit one TP group at 50 %
    full = costmodel._kv_bytes(model, (1 << 20) + 256, 1, 1, 8)
    assert full > 0.5 * dev.hbm_bytes
    short = costmodel.recommend(model, dev, costmodel.Mix(prompt=4096, decode_steps=512), tp=8)
    assert (short.pcp, short.dcp) == (1, 1)
    mla = costmodel.recommend(costmodel.MODELS["mla-671b"], costmodel.PRESETS["h200-sxm"],
                       costmodel.Mix(prompt=1 << 20, decode_steps=1024, decode_batch=8), tp=8)
    assert mla.fits
    choices = costmodel.evaluate(model, dev, costmodel.Mix(prompt=1 << 20, decode_steps=16), tp=8)
    assert {(c.pcp, c.dcp) for c in choices} == {(1, 1), (2, 1), (4, 1), (8, 1)}
    assert choices[0].efficiency == pytest.approx(1.0)


def _cited(source: str, unit: str) -> set[float]:
    """Numbers written before ``unit`` in a preset's source text (``~`` allowed)."""
    return {float(x) for x in re.findall(r"~?(\d+(?:\.\d+)?) " + re.escape(unit), source)}


@pytest.mark.parametrize("name", [n for n in costmodel.PRESETS if not n.startswith("cpu")])
def test_preset_figures_match_their_cited_source(name):
    """Each datasheet preset holds the numbers its ``source`` cites (a typo or a changed
    figure without a new citation fails here)."""
    dev = costmodel.PRESETS[name]
    assert dev.flops / 1e12 in _cited(dev.source, "TFLOP/s")
    assert dev.hbm_bytes / 1e9 in _cited(dev.source, "GB")
    assert dev.hbm_bw / 1e12 in _cited(dev.source, "TB/s")
    links = _cited(dev.source, "GB/s")
    assert dev.link_bw / 1e9 in links or 2 * dev.link_bw / 1e9 in links  # per direction
    assert 0 < dev.efficiency <= 1 and dev.link_latency_s > 0


def test_estimates_follow_the_device_figures():
    """Decode reads the KV cache (HBM bound), prefill computes: each moves with its figure."""
    model = costmodel.MODELS["llama3-70b"]
    h100, h200 = costmodel.PRESETS["h100-sxm"], costmodel.PRESETS["h200-sxm"]
    dec100 = costmodel.decode_estimate(model, h100, context=1 << 17, batch=8, tp=8)
    dec200 = costmodel.decode_estimate(model, h200, context=1 << 17, batch=8, tp=8)
    assert dec200.compute_s == pytest.approx(dec100.compute_s * h100.hbm_bw / h200.hbm_bw)
    assert dec200.comm_s == pytest.approx(dec100.comm_s)  # same links
    pre100 = costmodel.prefill_estimate(model, h100, 1 << 15, pcp=2, tp=8)
    pre200 = costmodel.prefill_estimate(model, h200, 1 << 15, pcp=2, tp=8)
    assert pre200.compute_s == pytest.approx(pre100.compute_s)  # same FLOP/s
