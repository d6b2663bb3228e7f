"""Causal prefill wall time, one thread per rank: SDPA and the bare op on one device, the
pcp=1 layer, pcp=2, and PyTorch's ring CP.

One request of S tokens (S = 8k, 16k, 32k), head size 64, fp32, one layer, no cached
context, for each (query heads, KV heads) of ``HEAD_SHAPES``: 4/4 (the MHA rows the cost model
validates on), 8/8 and 32/8 (GQA; SDPA and PyTorch's ring CP get ``enable_gqa=True``). Timed: the attention layer's forward on each rank (for cp_attention this
includes the K/V all-gather and the KV-cache write; for PyTorch's ring CP, the
``scaled_dot_product_attention`` call inside ``context_parallel``, which includes its ring
K/V exchange); the step time of a parallel run is the slowest rank's. pcp=1 runs in this
process (1 thread), the 2-rank runs in a :class:`RankPool` (1 thread per rank), through the
public backend classes (builder + impl forward; correctness is covered by the tests and
``launch/run_cp.py --check``). Single-device baselines in this process, 1 thread:
``F.scaled_dot_product_attention`` (what a user without CP runs) and the bare op
``get_ops("cpu").varlen_attention`` (the pcp=1 layer's kernel; ``pcp1_over_bare_op`` is the
layer's overhead: cache write, masks, bookkeeping). Minimum over repeats; process CPU seconds
are reported next to wall time because other users of the 2 cores inflate wall time.

    python -m benchmarks.bench_speed --out results/
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.common import (enable_torch_ring_cp_on_cpu, human_tokens, new_figure,
                               parse_args, save_figure, series_colors, write_json)
from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.common import StepSpec
from cp_attention.metadata.kv_layout import KVSharding
from cp_attention.ops import get_ops
from cp_attention.testing.pool import RankPool

NAME = "bench_speed"
HEAD_SIZE = 64
HEAD_SHAPES = ((4, 4), (8, 8), (32, 8))  # (query heads, KV heads)
QUICK_HEAD_SHAPES = ((4, 4), (8, 2))


def _prepare(pcp: int, rank: int, groups, tokens: int, heads: tuple[int, int]):
    """One rank's layer, metadata, local q/k/v rows and KV cache for a ``tokens`` prefill
    with ``heads`` = (query heads, KV heads)."""
    hq, hkv = heads
    cfg = CPConfig(pcp_size=pcp, block_size=128)
    ranks = groups.ranks if groups is not None else CPRanks.of(cfg, rank)
    num_blocks = int(KVSharding.of(cfg).blocks_needed(np.array([tokens]))[0]) + 1
    builder = CPAttentionBackend.get_builder_cls()(cfg, ranks, None, num_blocks)
    extra = {"groups": groups} if cfg.uses_cp else {}
    impl = CPAttentionBackend.get_impl_cls(cfg)(hq, HEAD_SIZE, HEAD_SIZE ** -0.5, hkv, **extra)
    spec = StepSpec((0,), (tokens,), torch.arange(num_blocks, dtype=torch.int32)[None])
    meta = builder.build(spec)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(meta.num_input_tokens, n, HEAD_SIZE, generator=gen)
               for n in (hq, hkv, hkv))
    cache = torch.zeros(CPAttentionBackend.get_kv_cache_shape(num_blocks, cfg.block_size, hkv,
                                                              HEAD_SIZE))
    return impl, meta, q, k, v, cache


def time_forward(pcp: int, rank: int, groups, tokens: int, repeats: int,
                 heads: tuple[int, int]) -> dict:
    """Wall and process-CPU seconds of the layer forward (min over ``repeats``)."""
    import torch.distributed as dist
    impl, meta, q, k, v, cache = _prepare(pcp, rank, groups, tokens, heads)
    out = torch.empty_like(q)
    walls, cpus = [], []
    for _ in range(repeats):
        if pcp > 1:
            dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        impl.forward(None, q, k, v, cache, meta, output=out)
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return {"wall_s": min(walls), "cpu_s": min(cpus), "walls": walls,
            "local_rows": meta.num_local_rows, "output_finite": bool(out.isfinite().all())}


def time_single_device(tokens: int, repeats: int, heads: tuple[int, int]) -> dict:
    """Wall seconds (min over ``repeats``) of the same problem on one device without a layer:
    ``F.scaled_dot_product_attention`` (what a user without CP calls) and the bare op
    ``get_ops("cpu").varlen_attention`` (the pcp=1 layer's kernel, no cache write, no
    bookkeeping)."""
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, n, HEAD_SIZE, generator=gen) for n in (heads[0], heads[1], heads[1]))
    cu = torch.tensor([0, tokens], dtype=torch.int64)
    ops = get_ops("cpu")
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, S, D]
    gqa = heads[0] != heads[1]
    calls = {"sdpa": lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True,
                                                            enable_gqa=gqa),
             "bare_op": lambda: ops.varlen_attention(q, k, v, cu, cu, scale=HEAD_SIZE ** -0.5,
                                                     causal=True)}
    for call in calls.values():  # warm-up (first-call allocations, kernel build)
        call()
    walls = {name: [] for name in calls}
    for _ in range(repeats):  # interleaved
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            walls[name].append(time.perf_counter() - start)
    return {f"{name}_s": min(w) for name, w in walls.items()} | {"ops": ops.name}


def cp_task(rank: int, get_groups, tokens: int, repeats: int = 1,
            heads: tuple[int, int] = (4, 4)) -> dict:
    """Pool task: cp_attention with pcp = world size."""
    import torch.distributed as dist
    pcp = dist.get_world_size()
    return time_forward(pcp, rank, get_groups(CPConfig(pcp_size=pcp, block_size=128)), tokens,
                        repeats, heads)


def torch_ring_task(rank: int, get_groups, tokens: int, repeats: int = 1,
                    heads: tuple[int, int] = (4, 4)) -> dict:
    """Pool task: the same causal problem through torch's context_parallel (ring attention)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    calls = enable_torch_ring_cp_on_cpu()
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, tokens, HEAD_SIZE, generator=gen)
               for n in (heads[0], heads[1], heads[1]))
    gqa = heads[0] != heads[1]
    before = calls["forward"]
    walls, cpus = [], []
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        for _ in range(repeats):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            cpus.append(time.process_time() - cpu)
            walls.append(time.perf_counter() - wall)
    return {"wall_s": min(walls), "cpu_s": min(cpus), "walls": walls,
            "ring_calls": (calls["forward"] - before) // repeats, "local_rows": int(out.shape[2])}


def _measure(pool: RankPool, tokens: int, heads: tuple[int, int], reps: int) -> dict:
    """One row: every implementation on a ``tokens`` prefill with ``heads`` (min of ``reps``)."""
    one = time_forward(1, 0, None, tokens, reps, heads)
    single = time_single_device(tokens, reps, heads)
    two = pool.run("benchmarks.bench_speed.cp_task", tokens, reps, heads, timeout_s=600)
    ring = pool.run("benchmarks.bench_speed.torch_ring_task", tokens, reps, heads,
                    timeout_s=600)
    s1, s2, sr = one["wall_s"], max(r["wall_s"] for r in two), max(r["wall_s"] for r in ring)
    c1, c2, cr = one["cpu_s"], max(r["cpu_s"] for r in two), max(r["cpu_s"] for r in ring)
    flops = 2.0 * tokens * tokens * heads[0] * HEAD_SIZE  # causal fwd: 4 * S^2/2 * Hq * D
    return {"tokens": tokens, "q_heads": heads[0], "kv_heads": heads[1], "repeats": reps,
            "pcp1_s": s1, "pcp2_s": s2, "torch_ring_s": sr,
            "sdpa_s": single["sdpa_s"], "bare_op_s": single["bare_op_s"],
            "pcp1_over_bare_op": s1 / single["bare_op_s"],
            "speedup_pcp2_vs_sdpa": single["sdpa_s"] / s2,
            "speedup_pcp2": s1 / s2, "efficiency_pcp2": s1 / (2 * s2),
            "speedup_torch_ring": s1 / sr,
            "cp_attention_vs_torch_ring": sr / s2,
            "cpu_pcp1_s": c1, "cpu_pcp2_s": c2, "cpu_torch_ring_s": cr,
            "cpu_speedup_pcp2": c1 / c2, "cpu_speedup_torch_ring": c1 / cr,
            "pcp1_gflops": flops / s1 / 1e9,
            "samples": {"pcp1": one["walls"], "pcp2": [r["walls"] for r in two],
                        "torch_ring": [r["walls"] for r in ring]},
            "torch_ring_calls_per_rank": min(r["ring_calls"] for r in ring),
            "local_rows": {"pcp1": one["local_rows"], "pcp2": [r["local_rows"] for r in two],
                           "torch_ring": [r["local_rows"] for r in ring]},
            "outputs_finite": one["output_finite"] and all(r["output_finite"] for r in two)}


def run(out_dir: str | Path, quick: bool = False, sizes=None, repeats: int | None = None,
        head_shapes=None) -> dict:
    sizes = sizes or ((512, 1024) if quick else (8192, 16384, 32768))
    repeats = repeats or (1 if quick else 3)
    head_shapes = head_shapes or (QUICK_HEAD_SHAPES if quick else HEAD_SHAPES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        with RankPool(2, collective_timeout_s=300) as pool:
            pool.run("benchmarks.bench_speed.cp_task", 256)  # warm up (imports, groups)
            pool.run("benchmarks.bench_speed.torch_ring_task", 256)
            for heads in head_shapes:
                for tokens in sizes:
                    rows.append(_measure(pool, tokens, heads,
                                         max(1, repeats if tokens < 32768 else repeats - 1)))
    finally:
        torch.set_num_threads(threads)
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    payload = {
        "what": "causal prefill, one layer, one request, fp32, 1 thread per rank",
        "shape": {"head_shapes": [list(h) for h in head_shapes], "head_size": HEAD_SIZE},
        "statistic": "wall: min over repeats, parallel time = slowest rank; cpu: process CPU "
                     "seconds of the same call (less sensitive to other users of the cores)",
        "torch_ring_options": str(_cp_options),
        "ops": get_ops("cpu").name,
        "rows": rows,
    }
    write_json(out_dir, NAME, payload)
    _plot(rows, out_dir)
    return payload


SERIES = (("sdpa_s", "SDPA (1 device, no layer)"),
          ("pcp1_s", "cp_attention pcp=1 layer"),
          ("pcp2_s", "cp_attention pcp=2"),
          ("torch_ring_s", "torch ring CP, 2 ranks"))


def _plot(rows, out_dir):
    """Times (left) and speedups over single-device SDPA (right); one colour per series."""
    fig, (ax1, ax2) = new_figure(2)
    colors = series_colors(key for key, _ in SERIES)
    x = list(range(len(rows)))
    shapes = {(r.get("q_heads"), r.get("kv_heads")) for r in rows}
    labels = [human_tokens(r["tokens"]) if len(shapes) == 1 else
              f'{r["q_heads"]}/{r["kv_heads"]} {human_tokens(r["tokens"])}' for r in rows]
    width = 0.8 / len(SERIES)
    for i, (key, label) in enumerate(SERIES):
        offset = (i - (len(SERIES) - 1) / 2) * width
        ax1.bar([xi + offset for xi in x], [r[key] for r in rows], width, label=label,
                color=colors[key])
        if key != "sdpa_s":
            ax2.plot(labels, [r["sdpa_s"] / r[key] for r in rows], "-o", label=label,
                     color=colors[key])
    ax1.set_xticks(x, labels)
    ax1.set(xlabel="heads (q/kv), prompt tokens", ylabel="wall seconds (one layer)", title="causal prefill time")
    ax1.legend(fontsize=8)
    ax2.axhline(2.0, color="grey", ls=":", label="ideal (2 ranks)")
    ax2.axhline(1.85, color="red", ls=":", label="goal 1.85x (pcp=2)")
    ax2.set(xlabel="heads (q/kv), prompt tokens", ylabel="speedup over single-device SDPA", ylim=(0, 2.2),
            title="speedup (2 ranks on a shared 2-core CPU)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    save_figure(fig, out_dir, NAME)
    return fig


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    payload = run(args.out, args.quick)
    for r in payload["rows"]:
        print(f"{r['q_heads']}/{r['kv_heads']} S={human_tokens(r['tokens'])}: pcp1 {r['pcp1_s']:.3f}s pcp2 {r['pcp2_s']:.3f}s "
              f"ring {r['torch_ring_s']:.3f}s | speedup pcp2 {r['speedup_pcp2']:.2f} "
              f"(eff {r['efficiency_pcp2']:.2f}), ring {r['speedup_torch_ring']:.2f}, "
              f"ours/ring {r['cp_attention_vs_torch_ring']:.2f} | sdpa {r['sdpa_s']:.3f}s "
              f"(pcp2 {r['speedup_pcp2_vs_sdpa']:.2f}x), pcp1/bare op "
              f"{r['pcp1_over_bare_op']:.3f} | cpu-time speedup pcp2 "
              f"{r['cpu_speedup_pcp2']:.2f}, ring {r['cpu_speedup_torch_ring']:.2f}")


if __name__ == "__main__":
    main()
