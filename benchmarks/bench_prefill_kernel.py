"""Causal prefill at 1 thread: ``CpuOps.varlen_attention`` (C++ kernel) vs PyTorch's CPU flash op, SDPA and
(when run in the vLLM venv) vLLM's ``cpu_attention_with_kv_cache`` in prefill mode.

    python -m benchmarks.bench_prefill_kernel --out results/ [--quick]
    python -m benchmarks.bench_prefill_kernel --out results/ --replot   # PNG from the JSON

Run it in the vLLM venv to get the vLLM column; that venv has no matplotlib, so the PNG is then
drawn by the ``--replot`` call in the main venv.

The implementations are timed round-robin in one process (same data, same machine state), so
their ratios are comparable even on a loaded machine; the JSON keeps wall and thread-CPU time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO_ROOT, new_figure, save_figure, write_json
from cp_attention.ops import CpuOps, get_ops
from cp_attention.ops.cpu_build import load_cpu_extension

NAME = "bench_prefill_kernel"
# (tokens, q heads, kv heads, head size, dtype)
CASES = [(2048, 8, 8, 64, torch.float32), (4096, 8, 8, 64, torch.float32),
         (8192, 8, 8, 64, torch.float32), (2048, 32, 8, 128, torch.bfloat16),
         (4096, 32, 8, 128, torch.bfloat16), (8192, 32, 8, 128, torch.bfloat16)]
QUICK_CASES = [(256, 8, 8, 64, torch.float32), (256, 8, 2, 128, torch.bfloat16)]


def _load_ours():
    """CpuOps with the C++ prefill kernel (fails loudly rather than timing ReferenceOps)."""
    ops = get_ops("cpu")
    if not isinstance(ops, CpuOps) or not hasattr(load_cpu_extension(), "varlen_attention"):
        raise RuntimeError("the C++ CPU kernels are not available (build failed or "
                           "CP_ATTENTION_OPS=reference)")
    return ops


def _vllm_ops():
    try:
        import vllm._custom_ops as ops  # only in the vLLM venv
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return ops if hasattr(ops, "cpu_attention_with_kv_cache") else None


def _callables(tokens, hq, hkv, d, dtype, ours, vllm_ops):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, hq, d, generator=gen).to(dtype)
    k = torch.randn(tokens, hkv, d, generator=gen).to(dtype)
    v = torch.randn(tokens, hkv, d, generator=gen).to(dtype)
    cu = torch.tensor([0, tokens])
    scale = d ** -0.5
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D] views
    calls = {
        "ours": lambda: ours.varlen_attention(q, k, v, cu, cu, scale=scale, causal=True),
        "aten_flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, True, scale=scale),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=hq != hkv),
    }
    if vllm_ops is not None:
        calls["vllm_cpu_attn"] = _vllm_prefill(vllm_ops, q, k, v, scale)
    return calls


def _vllm_prefill(ops, q, k, v, scale, block_size=128):
    """vLLM's CPU_ATTN kernel on a paged cache holding the whole prompt (prefill step)."""
    tokens, hq, d = q.shape
    hkv = k.shape[1]
    num_blocks = -(-tokens // block_size)
    kv = torch.zeros(num_blocks, hkv, block_size * 2, d, dtype=q.dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)  # vLLM's layout: [blocks, Hkv, block, D] views
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache,
                                   torch.arange(tokens, dtype=torch.long), "vec")
    query_start = torch.tensor([0, tokens], dtype=torch.int32)
    seq_lens = torch.tensor([tokens], dtype=torch.int32)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    meta = ops.cpu_attn_get_scheduler_metadata(1, hq, hkv, d, seq_lens, q.dtype, query_start,
                                               True, -1, "vec", False)
    out = torch.empty_like(q)
    return lambda: ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, query_start,
                                                   seq_lens, scale, True, None, -1, table, 0.0,
                                                   meta, None)


def _time_round_robin(calls: dict, repeats: int) -> dict:
    """Each callable once per round (after one warm-up round); wall and thread-CPU seconds."""
    for fn in calls.values():
        fn()
    wall = {name: [] for name in calls}
    cpu = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {name: {"wall_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name])}
            for name in calls}


def run(out_dir, quick: bool = False) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    ours, vllm_ops = _load_ours(), _vllm_ops()
    rows = []
    try:
        for tokens, hq, hkv, d, dtype in (QUICK_CASES if quick else CASES):
            repeats = 1 if quick or tokens >= 8192 else 3
            times = _time_round_robin(_callables(tokens, hq, hkv, d, dtype, ours, vllm_ops),
                                      repeats)
            flops = 4.0 * hq * d * tokens * (tokens + 1) / 2  # QK^T and PV over the causal half
            row = {"tokens": tokens, "q_heads": hq, "kv_heads": hkv, "head_size": d,
                   "dtype": str(dtype).replace("torch.", ""), "repeats": repeats, "times": times,
                   "ours_gflops": flops / times["ours"]["cpu_s"] / 1e9}
            for other in times:
                if other != "ours":
                    row[f"ours_over_{other}"] = times["ours"]["wall_s"] / times[other]["wall_s"]
                    row[f"ours_over_{other}_cpu"] = times["ours"]["cpu_s"] / times[other]["cpu_s"]
            rows.append(row)
            print(_describe(row), flush=True)
    finally:
        torch.set_num_threads(previous)
    payload = {"threads": 1, "vllm": vllm_ops is not None, "rows": rows}
    write_json(out_dir, NAME, payload)
    if importlib.util.find_spec("matplotlib") is not None:
        _plot(rows, out_dir)
    else:
        print("matplotlib missing here: draw the PNG with --replot in the main venv")
    return payload


def _label(row: dict) -> str:
    return (f"{row['tokens'] // 1024 or row['tokens']}{'k' if row['tokens'] >= 1024 else ''} "
            f"{row['q_heads']}/{row['kv_heads']} D{row['head_size']} {row['dtype']}")


def _describe(row: dict) -> str:
    parts = [f"{name} {t['wall_s']:.3f}s" for name, t in row["times"].items()]
    ratios = [f"{k}={v:.2f}" for k, v in row.items() if k.startswith("ours_over_")
              and not k.endswith("_cpu")]
    return f"{_label(row)}: " + ", ".join(parts) + " | " + ", ".join(ratios)


def _plot(rows, out_dir) -> None:
    fig, (ax,) = new_figure(width=9.0)
    names = list(rows[0]["times"]) if rows else []
    width = 0.8 / max(1, len(names))
    for n, name in enumerate(names):
        ax.bar([i + n * width for i in range(len(rows))],
               [r["times"][name]["wall_s"] for r in rows], width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(rows))],
                  [_label(r) for r in rows], rotation=20, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (1 thread, median)")
    ax.set_title("Causal prefill, one request, 1 thread")
    ax.legend()
    save_figure(fig, out_dir, NAME)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO_ROOT / "results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG")
    args = parser.parse_args(argv)
    if args.replot:
        _plot(json.loads((Path(args.out) / f"{NAME}.json").read_text())["rows"], args.out)
    else:
        run(args.out, args.quick)


if __name__ == "__main__":
    main()
