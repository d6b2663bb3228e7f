"""Cost of the checks of one layer call: the O(1) check every ``forward`` makes, the O(n)
value checks of debug mode, and the whole ``forward`` for scale.

A single-device decode step of R requests (R = 1 .. 256) with C cached tokens each, block size
16, 8 query heads / 2 KV heads of size 64, fp32, 1 thread; min over interleaved repeats.

    python -m benchmarks.bench_forward_checks --out results/
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import new_figure, parse_args, save_figure, series_colors, time_call, write_json
from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig
from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.impl.checks import check_forward_call, check_forward_values
from cp_attention.metadata.builder import MetadataBuilder
from cp_attention.metadata.common import StepSpec

NAME = "bench_forward_checks"
HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 64, 16
SERIES = (("check_us", "forward check, O(1) (always)"),
          ("debug_us", "value checks, O(n) (debug mode)"),
          ("forward_us", "whole forward"))


def measure(num_reqs: int, context: int, repeats: int) -> dict:
    blocks_per_req = context // BLOCK + 1
    num_blocks = num_reqs * blocks_per_req
    table = torch.arange(num_blocks, dtype=torch.int32).view(num_reqs, blocks_per_req)
    step = StepSpec((context,) * num_reqs, (1,) * num_reqs, table)
    meta = MetadataBuilder(CPConfig(block_size=BLOCK), num_blocks=num_blocks).build(step)
    impl = BaseAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, debug=False)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_reqs, HEADS, HEAD_SIZE, generator=gen)
    k, v = (torch.randn(num_reqs, KV_HEADS, HEAD_SIZE, generator=gen) for _ in range(2))
    cache = torch.randn(CPAttentionBackend.get_kv_cache_shape(num_blocks, BLOCK, KV_HEADS,
                                                              HEAD_SIZE), generator=gen)
    out = torch.empty_like(q)
    calls = {"check_us": lambda: check_forward_call(impl, None, q, k, v, cache, meta, out),
             "debug_us": lambda: check_forward_values(q, k, v, cache, meta),
             "forward_us": lambda: impl.forward(None, q, k, v, cache, meta, output=out)}
    best = {key: float("inf") for key in calls}
    for _ in range(repeats):  # interleaved, so load changes hit every series
        for key, fn in calls.items():
            inner = 50 if key == "check_us" else 1
            best[key] = min(best[key], time_call(lambda: [fn() for _ in range(inner)], repeats=1,
                                                 warmup=1)["min_s"] / inner * 1e6)
    return {"num_reqs": num_reqs, "context": context, **best,
            "check_share_of_forward": best["check_us"] / best["forward_us"]}


def run(out_dir: str | Path, quick: bool = False) -> dict:
    sizes = (1, 16) if quick else (1, 4, 16, 64, 256)
    context = 256 if quick else 4096
    repeats = 2 if quick else 7
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [measure(n, context, repeats) for n in sizes]
    finally:
        torch.set_num_threads(threads)
    payload = {"what": "per-call seconds of the forward checks (impl/checks.py) and of forward, "
                       "decode steps, fp32, 1 thread, min over interleaved repeats",
               "shape": {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
                         "block_size": BLOCK},
               "rows": rows,
               "check_us_spread": max(r["check_us"] for r in rows) / min(r["check_us"] for r in rows)}
    write_json(out_dir, NAME, payload)
    _plot(rows, out_dir)
    return payload


def _plot(rows, out_dir):
    fig, (ax,) = new_figure()
    colors = series_colors(key for key, _ in SERIES)
    x = [r["num_reqs"] for r in rows]
    for key, label in SERIES:
        ax.plot(x, [r[key] for r in rows], "-o", color=colors[key], label=label)
    ax.set(xscale="log", yscale="log", xlabel="decode requests in the step",
           ylabel="microseconds per call",
           title=f"checks of one layer call ({rows[0]['context']} cached tokens per request)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, out_dir, NAME)
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    for r in run(args.out, args.quick)["rows"]:
        print(f"R={r['num_reqs']}: check {r['check_us']:.1f} us, debug {r['debug_us']:.0f} us, "
              f"forward {r['forward_us'] / 1e3:.1f} ms (check = "
              f"{100 * r['check_share_of_forward']:.2f} % of forward)")


if __name__ == "__main__":
    main()
