"""Cost model: fit the CPU preset, validate it against measurements, plot predictions.

1. Fit ``cpu-gloo-this-machine``: single-thread causal attention FLOP/s (SDPA, fp32, the
   bench_speed shape) and a gloo all-gather over 2 loopback ranks (t = latency + bytes/bw,
   least squares over 4 KiB..16 MiB).
2. Validate: predicted vs measured prefill times and pcp=2 speedup for the problems of
   ``results/bench_speed.json`` (run ``benchmarks.bench_speed`` first; skipped if missing).
3. Predict: PCP prefill efficiency for 128k..1M-token prompts (llama3-70b shape, tp=8) on the
   H100 / H200 / Ascend 910B presets; DCP/PCP decode step speedup vs context (MLA-style shape,
   one KV head, tp=8); recommended (pcp, dcp) for a few prefill/decode mixes.

    python -m benchmarks.bench_cost_model --out results/
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import (human_tokens, new_figure, parse_args, save_figure, series_colors,
                               token_ticks, write_json)
from cp_attention import costmodel
from cp_attention.testing.pool import RankPool

NAME = "bench_cost_model"
PLOT_NAME = "cost_model"
SPEED_SHAPE = costmodel.ModelShape(num_layers=1, num_heads=4, num_kv_heads=4, head_size=64,
                                   dtype_bytes=4)


def measure_flops(tokens: int, repeats: int = 3) -> float:
    """Causal fp32 attention FLOP/s on one thread (2 S^2 H D FLOPs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        h, d = SPEED_SHAPE.num_heads, SPEED_SHAPE.head_size
        q, k, v = (torch.randn(1, h, tokens, d) for _ in range(3))
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 4 * h * d * tokens * (tokens + 1) / 2 / best


def allgather_task(rank: int, get_groups, sizes: list[int], repeats: int) -> list[float]:
    """Pool task: median seconds of a gloo all-gather of ``n`` bytes per rank, per size."""
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        buf = torch.empty(dist.get_world_size() * x.numel())
        gather(buf, x)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            gather(buf, x)
            samples.append(time.perf_counter() - start)
        out.append(statistics.median(samples))
    return out


def fit_link(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """t = latency + bytes / bw (2 ranks: bytes sent = input bytes). Latency: the smallest
    message's time; bandwidth: least-squares slope over the messages of >= 1 MiB (a plain
    least-squares intercept goes negative under load)."""
    latency = float(min(seconds[0], min(seconds)))
    big = [(b, t) for b, t in zip(sizes, seconds) if b >= 1 << 20] or list(zip(sizes, seconds))
    if len(big) >= 2:
        slope = float(np.polyfit([b for b, _ in big], [t for _, t in big], 1)[0])
    else:
        slope = (big[0][1] - latency) / big[0][0]
    return latency, 1.0 / max(slope, 1e-15)


def speed_rows(speed_json: Path) -> list[dict]:
    """bench_speed's rows of SPEED_SHAPE's heads (4/4; rows without heads predate the axis)."""
    return [r for r in json.loads(speed_json.read_text())["rows"]
            if (r.get("q_heads", 4), r.get("kv_heads", 4)) == (4, 4)]


def validate(device: costmodel.Device, speed_json: Path) -> list[dict]:
    if not speed_json.exists():
        return []
    rows = []
    for r in speed_rows(speed_json):
        s = r["tokens"]
        p1 = costmodel.prefill_estimate(SPEED_SHAPE, device, s, 1).total_s
        p2 = costmodel.prefill_estimate(SPEED_SHAPE, device, s, 2).total_s
        rows.append({"tokens": s, "pcp1_predicted_s": p1, "pcp1_measured_s": r["pcp1_s"],
                     "pcp2_predicted_s": p2, "pcp2_measured_s": r["pcp2_s"],
                     "speedup_predicted": p1 / p2, "speedup_measured": r["speedup_pcp2"],
                     "speedup_ratio_measured_over_predicted": r["speedup_pcp2"] / (p1 / p2)})
    return rows


def predictions(prompts) -> dict:
    prefill, decode = [], []
    model = costmodel.MODELS["llama3-70b"]
    for name in ("h100-sxm", "h200-sxm", "ascend-910b"):
        dev = costmodel.PRESETS[name]
        for pcp in (2, 4, 8):
            for p in prompts:
                est = costmodel.prefill_estimate(model, dev, p, pcp, tp=8)
                prefill.append({"device": name, "pcp": pcp, "prompt": p,
                                "efficiency": costmodel.prefill_efficiency(model, dev, p, pcp,
                                                                           tp=8),
                                "compute_s": est.compute_s, "comm_s": est.comm_s})
    mla = costmodel.MODELS["mla-671b"]
    for name in ("h100-sxm", "h200-sxm", "ascend-910b"):
        dev = costmodel.PRESETS[name]
        for pcp, dcp in ((1, 2), (1, 4), (1, 8), (2, 8), (4, 8)):
            for ctx in prompts:
                base = costmodel.decode_estimate(mla, dev, ctx, 8, 1, 8, 1).total_s
                est = costmodel.decode_estimate(mla, dev, ctx, 8, pcp, 8, dcp)
                decode.append({"device": name, "pcp": pcp, "dcp": dcp, "context": ctx,
                               "batch": 8, "step_s": est.total_s, "comm_s": est.comm_s,
                               "speedup_over_1x1": base / est.total_s,
                               "kv_gb_per_rank": est.kv_bytes_per_rank / 1e9})
    mixes = []
    for model_name, tp in (("llama3-70b", 8), ("mla-671b", 8)):
        for dev_name in ("h100-sxm", "h200-sxm", "ascend-910b"):
            for mix in (costmodel.Mix(4096, 512, 32), costmodel.Mix(131072, 1024, 8),
                        costmodel.Mix(1 << 20, 1024, 1)):
                best = costmodel.recommend(costmodel.MODELS[model_name],
                                           costmodel.PRESETS[dev_name], mix, tp)
                mixes.append({"model": model_name, "device": dev_name, "tp": tp, "mix": asdict(mix),
                              "recommended": asdict(best)})
    return {"prefill_efficiency": prefill, "decode_speedup": decode, "recommendations": mixes}


def run(out_dir: str | Path, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    flops = measure_flops(1024 if quick else 4096, repeats=1 if quick else 3)
    sizes = [4096, 65536, 1 << 20] if quick else [4096, 16384, 65536, 262144, 1 << 20, 4 << 20,
                                                    16 << 20]
    with RankPool(2) as pool:
        times = pool.run("benchmarks.bench_cost_model.allgather_task", sizes, 3 if quick else 7)
    seconds = [max(a, b) for a, b in zip(*times)]
    latency, bw = fit_link(sizes, seconds)
    stored = costmodel.PRESETS["cpu-gloo-this-machine"]
    speed_json = out_dir / "bench_speed.json"
    flops_source = "micro-benchmark (SDPA, 1 thread)"
    fit_flops = flops
    if speed_json.exists():  # same run, same load as the pcp=2 times it is compared with
        fit_flops = statistics.median(r["pcp1_gflops"] * 1e9 for r in speed_rows(speed_json))
        flops_source = "median pcp=1 FLOP/s of bench_speed.json (same run as the pcp=2 times)"
    fitted = replace(stored, flops=fit_flops, link_bw=bw, link_latency_s=latency)
    prompts = (131072, 262144, 524288, 1048576)
    payload = {
        "fit": {"attention_flops_1_thread": flops, "fitted_flops": fit_flops,
                "fitted_flops_source": flops_source,
                "allgather_bytes": sizes, "allgather_seconds": seconds,
                "link_latency_s": latency, "link_bw_bytes_per_s": bw,
                "stored_preset": asdict(stored)},
        "validation_fitted": validate(fitted, speed_json),
        "validation_stored_preset": validate(stored, speed_json),
        "validation_source": str(speed_json) if speed_json.exists() else "missing: run bench_speed",
        "predictions": predictions(prompts),
        "presets": {k: asdict(v) for k, v in costmodel.PRESETS.items()},
    }
    write_json(out_dir, NAME, payload)
    _plot(payload, prompts, out_dir)
    return payload


def _plot(payload, prompts, out_dir) -> None:
    fig, (ax1, ax2, ax3) = new_figure(3, width=5.2)
    styles = {"h100-sxm": "-", "h200-sxm": "--", "ascend-910b": ":"}
    combos = sorted({(r["pcp"], r["dcp"]) for r in payload["predictions"]["decode_speedup"]})
    colors = series_colors([(pcp, 1) for pcp in (2, 4, 8)] + combos)  # (pcp, dcp): both panels
    rows = payload["predictions"]["prefill_efficiency"]
    for dev, style in styles.items():
        for pcp in (2, 4, 8):
            mine = [r for r in rows if r["device"] == dev and r["pcp"] == pcp]
            ax1.plot([r["prompt"] for r in mine], [r["efficiency"] for r in mine], style,
                     marker="o", color=colors[(pcp, 1)],
                     label=f"pcp={pcp}" if dev == "h100-sxm" else None)
    ax1.set(xscale="log", xlabel="prompt tokens", ylabel="predicted parallel efficiency",
            title="PCP prefill (llama3-70b, tp=8)\n- H100, -- H200 (same: compute-bound), : 910B")
    token_ticks(ax1, prompts)
    ax1.legend(fontsize=6, ncol=1)
    ax1.grid(alpha=0.3)
    rows = payload["predictions"]["decode_speedup"]
    for dev, style in styles.items():
        for combo in combos:
            mine = [r for r in rows if r["device"] == dev and (r["pcp"], r["dcp"]) == combo]
            ax2.plot([r["context"] for r in mine], [r["speedup_over_1x1"] for r in mine], style,
                     marker=".", color=colors[combo],
                     label=f"pcp={combo[0]} dcp={combo[1]}" if dev == "h100-sxm" else None)
    ax2.set(xscale="log", xlabel="context tokens", ylabel="decode step speedup vs pcp=dcp=1",
            title="decode (MLA-style, 1 KV head, tp=8, batch 8)\n- H100, -- H200, : 910B")
    token_ticks(ax2, prompts)
    ax2.legend(fontsize=6)
    ax2.grid(alpha=0.3)
    val = payload["validation_fitted"]
    if val:
        labels = [human_tokens(r["tokens"]) for r in val]
        ax3.plot(labels, [r["speedup_measured"] for r in val], "-o", label="measured pcp=2 speedup")
        ax3.plot(labels, [r["speedup_predicted"] for r in val], "--s",
                 label="predicted (fitted CPU preset)")
        ax3.set_ylim(0, 2.2)
    ax3.set(xlabel="prompt tokens", ylabel="speedup pcp=2 over pcp=1",
            title="CPU validation (2 shared cores, gloo)")
    ax3.legend(fontsize=7)
    ax3.grid(alpha=0.3)
    save_figure(fig, out_dir, PLOT_NAME)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    payload = run(args.out, args.quick)
    fit = payload["fit"]
    print(f"fit: {fit['fitted_flops'] / 1e9:.1f} GFLOP/s/thread ({fit['fitted_flops_source']}; "
          f"micro-benchmark now {fit['attention_flops_1_thread'] / 1e9:.1f}), gloo latency "
          f"{fit['link_latency_s'] * 1e6:.0f} us, bw {fit['link_bw_bytes_per_s'] / 1e9:.2f} GB/s")
    for r in payload["validation_fitted"]:
        print(f"S={human_tokens(r['tokens'])}: pcp1 pred {r['pcp1_predicted_s']:.3f}s meas "
              f"{r['pcp1_measured_s']:.3f}s; pcp2 pred {r['pcp2_predicted_s']:.3f}s meas "
              f"{r['pcp2_measured_s']:.3f}s; speedup pred {r['speedup_predicted']:.2f} meas "
              f"{r['speedup_measured']:.2f}")
    for m in payload["predictions"]["recommendations"]:
        rec = m["recommended"]
        print(f"{m['model']} on {m['device']} mix {m['mix']}: pcp={rec['pcp']} dcp={rec['dcp']} "
              f"(eff {rec['efficiency']:.2f}, fits {rec['fits']})")


if __name__ == "__main__":
    main()
