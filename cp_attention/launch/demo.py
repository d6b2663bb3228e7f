"""``cp-attn``: the CP demo on local processes, one per rank, checked against float64.
``cp-attn build``: compile the C++ CPU kernels ahead of time (see
:func:`cp_attention.ops.cpu_build.build_main`), so no process compiles them in its first call.

Runs a multi-step workload (long prompts, a prompt continued over cached context, chunked
prefill, decodes) on pcp x tp local ranks and prints, per rank, tokens computed, KV bytes held,
bytes communicated, time and the largest error against the float64 oracle; then what CP buys:
the KV cache of the largest rank vs one device holding the same requests, and the prefill
step's time on the slowest rank vs one rank running the same prefill alone (all heads), both
measured in this run. Ranks run on the device ``--device`` picks (auto: one NPU or GPU per
rank when the host has enough, else the CPU over gloo) with that device's ops; the output says
which ops, device and collective backend ran.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch

from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig
from cp_attention.launch.device import (DEVICE_CHOICES, DeviceUnavailableError, choose_device,
                                        probe_device_counts, set_current_device)
from cp_attention.ops.cpu_build import build_main
from cp_attention.testing.pool import RankPool
from cp_attention.testing.workload import (DTYPES, ORACLE_TOLERANCE, RankReport, Workload,
                                           allocate_blocks, run_workload)

TASK = "cp_attention.testing.workload.run_workload_task"


def demo_workload(config: CPConfig, prompt: int, dtype: str) -> Workload:
    """Two long prompts and a short one; then a prefix-hit continuation, a chunked prefill,
    and decodes mixed with prefill chunks. Step 0 is the prefill the speedup is measured on."""
    steps = [
        ((0, prompt), (1, prompt // 2), (2, 7)),  # prefill, no cache
        ((0, 1), (1, 1), (2, 1)),  # decode only
        ((2, prompt // 4),),  # prefix hit: new tokens over cached context
        ((0, 1), (1, 1), (3, prompt // 2)),  # decodes + first chunk of a chunked prefill
        ((0, 1), (1, 1), (3, prompt // 2)),  # decodes + second chunk
    ] + [((0, 1), (1, 1), (2, 1), (3, 1))] * 4
    return Workload(config, tuple(steps), num_heads=8, num_kv_heads=1, head_size=64, dtype=dtype)


def kv_cache_bytes(w: Workload) -> int:
    """Bytes of the KV cache one rank of ``w.config`` allocates for the workload (all its
    requests at their final lengths), as :func:`run_workload` allocates it."""
    _, num_blocks = allocate_blocks(w)
    shape = CPAttentionBackend.get_kv_cache_shape(num_blocks, w.config.block_size,
                                                  w.num_kv_heads, w.head_size)
    return torch.Size(shape).numel() * DTYPES[w.dtype].itemsize


def single_rank_prefill_seconds(w: Workload, device: torch.device) -> float:
    """The prefill step (step 0) of ``w`` on one rank holding every head, one CPU thread (as each
    demo rank has); best of two runs after a warm-up."""
    single = replace(w, config=CPConfig(block_size=w.config.block_size), steps=w.steps[:1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_workload(warmup_workload(single), check=False, device=device)
        return min(run_workload(single, check=False, device=device).seconds_per_step[0]
                   for _ in range(2))
    finally:
        torch.set_num_threads(threads)


def warmup_workload(w: Workload) -> Workload:
    """A small prefill + decode of the same shape, to pay first-call costs before timing."""
    return replace(w, steps=(((0, 64), (1, 9)), ((0, 1), (1, 1))))


def cores_available() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["build"]:  # `cp-attn build [--verbose]`; plain `cp-attn` runs the demo
        raise SystemExit(build_main(argv[1:]))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommand: `cp-attn build [--verbose]` compiles the C++ CPU kernels now "
               "and prints where they are and how long it took")
    parser.add_argument("--pcp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dcp", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=2048, help="tokens of the longest prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=sorted(ORACLE_TOLERANCE))
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                        help="auto: one NPU/GPU per rank if the host has enough, else cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    config = CPConfig(pcp_size=args.pcp, tp_size=args.tp, dcp_size=args.dcp,
                      block_size=args.block_size, cp_kv_interleave_size=args.interleave)
    workload = demo_workload(config, args.prompt, args.dtype)
    config.validate_heads(workload.num_heads, workload.num_kv_heads)
    world = config.world_size
    cuda, npu = probe_device_counts(args.device)
    try:  # every rank is a local process: rank i gets device i
        choice = choose_device(args.device, cuda_count=cuda, npu_count=npu, local_rank=0,
                               local_world_size=world)
    except DeviceUnavailableError as exc:
        raise SystemExit(f"cp-attn: {exc}") from None
    device = choice.device  # the main process's device: rank 0's, for the single-rank run
    set_current_device(device)
    cores = cores_available()
    total_new = sum(n for step in workload.steps for _, n in step)
    print(f"cp_attention demo: pcp={args.pcp} tp={args.tp} dcp={args.dcp}: {world} local "
          f"processes on {choice.type}{'' if choice.type == 'cpu' else ' (one device each)'}, "
          f"{cores} CPU cores; {len(workload.steps)} steps, {total_new} new tokens, {args.dtype}")
    if choice.note:
        print(f"note: {choice.note}")
    start = time.perf_counter()
    with RankPool(world, device_type=choice.type) as pool:
        pool.run(TASK, warmup_workload(workload), False, timeout_s=600)
        reports: list[RankReport] = pool.run(TASK, workload, timeout_s=600)
    wall = time.perf_counter() - start
    print(f"{'rank':>4} {'pcp':>3} {'tp':>3} {'tokens':>8} {'KV bytes':>12} {'comm bytes':>12} "
          f"{'attn s':>8} {'max err':>9} cache")
    for rank, rep in enumerate(reports):
        pcp_rank, tp_rank = divmod(rank, config.tp_size)
        tokens = sum(len(t) for t in rep.tokens_per_step)
        print(f"{rank:>4} {pcp_rank:>3} {tp_rank:>3} {tokens:>8} {rep.cache_bytes:>12,} "
              f"{rep.comm_bytes:>12,} {rep.seconds:>8.3f} {rep.max_err:>9.2e} "
              f"{'exact' if rep.cache_exact else 'WRONG'}")
    ran = sorted({(r.ops, r.device.split(":")[0], r.backend) for r in reports})
    print("ran: " + "; ".join(f"{ops} on {dev} over {backend}" for ops, dev, backend in ran))

    kv_rank = max(r.cache_bytes for r in reports)
    kv_single = kv_cache_bytes(replace(workload, config=CPConfig(block_size=args.block_size)))
    prefill_tokens = sum(n for _, n in workload.steps[0])
    cp_prefill = max(r.seconds_per_step[0] for r in reports)  # the slowest rank sets the pace
    one_prefill = single_rank_prefill_seconds(workload, device)
    speedup = one_prefill / cp_prefill
    tol = ORACLE_TOLERANCE[args.dtype]
    worst = max(r.max_err for r in reports)
    ok = all(r.cache_exact and not r.any_nan for r in reports) and worst <= tol
    print(f"KV cache: {kv_rank / 2**20:.2f} MiB on the largest rank vs {kv_single / 2**20:.2f} "
          f"MiB on one device ({kv_single / kv_rank:.1f}x less per rank)")
    print(f"prefill ({prefill_tokens} tokens): {cp_prefill:.3f} s on the slowest of {world} ranks "
          f"vs {one_prefill:.3f} s on one rank = {speedup:.2f}x speedup "
          f"({world} processes on {cores} CPU cores, 1 thread each"
          f"{'' if choice.type == 'cpu' else f', one {choice.type} each'})")
    print(f"{'OK' if ok else 'MISMATCH'}: worst error vs float64 {worst:.2e} (tolerance {tol:g}, "
          f"{args.dtype}); wall {wall:.1f} s incl. process start")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=dict(pcp=args.pcp, tp=args.tp, dcp=args.dcp, prompt=args.prompt,
                                       dtype=args.dtype), device=choice.type, note=choice.note,
                           ran=[dict(ops=o, device=d, backend=b) for o, d, b in ran],
                           processes=world, cpu_cores=cores, kv_bytes_per_rank=kv_rank,
                           kv_bytes_one_device=kv_single, prefill_tokens=prefill_tokens,
                           prefill_s_cp=cp_prefill, prefill_s_one_rank=one_prefill,
                           prefill_speedup=speedup, worst_err=worst, tolerance=tol, ok=ok,
                           ranks=[dict(device=r.device, ops=r.ops, backend=r.backend,
                                       max_err=r.max_err, cache_exact=r.cache_exact,
                                       cache_bytes=r.cache_bytes, comm_bytes=r.comm_bytes,
                                       prefill_s=r.seconds_per_step[0]) for r in reports]),
                      f, indent=2)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
