"""Overhead of the portable op: ``ReferenceOps.varlen_attention`` vs PyTorch SDPA.

The same causal problem on one device, 1 thread, fp32: one request of S tokens, 8 query heads
and 8 KV heads, head size 64 (SDPA on [1, H, S, D]); and a varlen batch of 4 requests of S/4
tokens (SDPA called per request, the fair equivalent without padding). Ratio = ours / SDPA.
Both call the same CPU flash kernel underneath, so the ratio measures layout and bookkeeping
overhead (transposes, LSE, per-request slicing).

    python -m benchmarks.bench_op_overhead --out results/
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from benchmarks.common import human_tokens, new_figure, parse_args, save_figure, time_call, write_json
from cp_attention.ops.reference import ReferenceOps

NAME = "bench_op_overhead"
HEADS, HEAD_SIZE = 8, 64


def measure(tokens: int, num_reqs: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, HEADS, HEAD_SIZE, generator=gen) for _ in range(3))
    cu = torch.arange(0, tokens + 1, tokens // num_reqs, dtype=torch.int64)
    scale = HEAD_SIZE ** -0.5
    ops = ReferenceOps()

    def ours():
        return ops.varlen_attention(q, k, v, cu, cu, scale=scale, causal=True)

    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    bounds = cu.tolist()

    def sdpa():
        return [F.scaled_dot_product_attention(qs[..., a:b, :], ks[..., a:b, :], vs[..., a:b, :],
                                               is_causal=True, scale=scale)
                for a, b in zip(bounds[:-1], bounds[1:])]

    ref = torch.cat(sdpa(), dim=2)[0].transpose(0, 1)
    err = (ours()[0] - ref).abs().max().item()
    a, b = [], []
    for _ in range(repeats):  # interleave the two so load changes hit both
        a.append(time_call(ours, repeats=1, warmup=0)["min_s"])
        b.append(time_call(sdpa, repeats=1, warmup=0)["min_s"])
    return {"tokens": tokens, "num_reqs": num_reqs, "ours_s": min(a), "sdpa_s": min(b),
            "overhead_ratio": min(a) / min(b), "max_abs_diff": err}


def run(out_dir: str | Path, quick: bool = False) -> dict:
    sizes = (256, 512) if quick else (1024, 2048, 4096, 8192)
    repeats = 2 if quick else 5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [measure(s, n, repeats) for s in sizes for n in (1, 4)]
    finally:
        torch.set_num_threads(threads)
    payload = {"what": "ReferenceOps.varlen_attention / F.scaled_dot_product_attention, causal,"
                       " fp32, 1 thread, min over interleaved repeats",
               "shape": {"num_heads": HEADS, "num_kv_heads": HEADS, "head_size": HEAD_SIZE},
               "rows": rows,
               "max_overhead_ratio": max(r["overhead_ratio"] for r in rows)}
    write_json(out_dir, NAME, payload)
    fig, (ax,) = new_figure()
    for i, n in enumerate((1, 4)):
        mine = [r for r in rows if r["num_reqs"] == n]
        ax.plot([human_tokens(r["tokens"]) for r in mine], [r["overhead_ratio"] for r in mine],
                "-o", color=f"C{i}", label=f"{n} request(s)")
    ax.axhline(1.0, color="grey", ls=":")
    ax.set(xlabel="tokens in the batch", ylabel="time ours / SDPA",
           title="ReferenceOps.varlen_attention overhead (causal, fp32)")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, out_dir, NAME)
    return payload


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    for r in run(args.out, args.quick)["rows"]:
        print(f"S={human_tokens(r['tokens'])} reqs={r['num_reqs']}: ours {r['ours_s'] * 1e3:.1f} ms"
              f" sdpa {r['sdpa_s'] * 1e3:.1f} ms ratio {r['overhead_ratio']:.3f} "
              f"(max diff {r['max_abs_diff']:.1e})")


if __name__ == "__main__":
    main()
