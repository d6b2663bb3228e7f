"""torchrun entry point: CP prefill + decodes on real tensors, one process per rank.

Single node, 4 ranks (pcp=2 x tp=2, dcp=2)::

    torchrun --nproc-per-node 4 launch/run_cp.py --pcp 2 --tp 2 --dcp 2 --prompt 4096 --check

Multi-node (2 nodes x 8 ranks; run on every node with its --node-rank)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
        --master-addr node0.example --master-port 29500 \\
        launch/run_cp.py --pcp 4 --tp 4 --dcp 4 --prompt 131072
    # or elastic rendezvous instead of master addr/port:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint node0.example:29400 --rdzv-id cp-job-1 launch/run_cp.py ...

The world must be ``pcp * tp`` processes (rank = pcp_rank * tp + tp_rank). The collective
backend follows the detected device (gloo on CPU, nccl on CUDA, hccl on NPU); the workload
runner (:func:`cp_attention.testing.workload.run_workload`) keeps its tensors on the CPU, so
on an accelerator host this entry point runs on the CPU over gloo and says so. With
``--check`` every rank compares each of its output rows with the float64 oracle and checks
its KV-cache shard exactly; the exit status is 1 if any rank fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch
import torch.distributed as dist

from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig
from cp_attention.parallel import CPGroups, detect_device
from cp_attention.testing.workload import Workload, run_workload

# Largest |CP output - float64 oracle| accepted by --check, per activation dtype.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_cp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pcp", type=int, default=1, help="prefill context-parallel size")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--dcp", type=int, default=1, help="decode context-parallel size (divides tp)")
    parser.add_argument("--prompt", type=int, default=4096, help="tokens of the longest prompt")
    parser.add_argument("--requests", type=int, default=2,
                        help="prompts of prompt, prompt/2, prompt/4, ... tokens")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps after the prefill")
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=None,
                        help="default: 1 when dcp > 1 (vLLM's DCP rule), else num_heads")
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--interleave", type=int, default=1, help="cp_kv_interleave_size")
    parser.add_argument("--kv-shard", default="cp", choices=["cp", "dcp"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with the float64 oracle")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu"],
                        help="auto: detect (npu > cuda > cpu); the runner itself is CPU-only")
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout (s)")
    parser.add_argument("--json", default=None, help="rank 0 writes every rank's report here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def make_workload(args: argparse.Namespace, config: CPConfig) -> Workload:
    """Prefill of ``requests`` prompts in one step, then ``decode_steps`` decodes of all."""
    prompts = [max(1, args.prompt >> i) for i in range(args.requests)]
    steps = [tuple((r, n) for r, n in enumerate(prompts))]
    steps += [tuple((r, 1) for r in range(args.requests))] * args.decode_steps
    kv_heads = args.num_kv_heads or (1 if args.dcp > 1 else args.num_heads)
    return Workload(config, tuple(steps), num_heads=args.num_heads, num_kv_heads=kv_heads,
                    head_size=args.head_size, dtype=args.dtype, seed=args.seed)


def resolve_device(choice: str, rank: int) -> torch.device:
    """The device the runner uses: always CPU today (see module doc), with a note if not."""
    if choice == "cpu":
        return torch.device("cpu")
    detected = detect_device()
    if detected.type != "cpu" and rank == 0:
        print(f"note: detected {detected}; run_workload keeps tensors on the CPU, so this run "
              "uses the CPU with gloo", file=sys.stderr)
    return torch.device("cpu")


@contextmanager
def step_progress(builder_cls: type, total: int, enabled: bool):
    """A tqdm bar advanced once per step (wraps the builder's ``build`` for the duration)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="steps", unit="step", disable=not enabled, file=sys.stderr)
    had_own = "build" in builder_cls.__dict__
    original = builder_cls.build

    def build(self, *a, **kw):
        result = original(self, *a, **kw)
        bar.update(1)
        return result

    builder_cls.build = build
    try:
        yield bar
    finally:
        if had_own:
            builder_cls.build = original
        else:
            del builder_cls.build
        bar.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = CPConfig(pcp_size=args.pcp, tp_size=args.tp, dcp_size=args.dcp,
                      block_size=args.block_size, cp_kv_interleave_size=args.interleave,
                      kv_shard=args.kv_shard)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != config.world_size:
        raise SystemExit(f"run_cp: launched with WORLD_SIZE={world} processes but pcp * tp = "
                         f"{config.world_size}: use torchrun --nproc-per-node (x --nnodes) = "
                         f"{config.world_size}")
    rank = int(os.environ.get("RANK", "0"))
    workload = make_workload(args, config)
    config.validate_heads(workload.num_heads, workload.num_kv_heads)
    device = resolve_device(args.device, rank)
    if "MASTER_ADDR" not in os.environ:  # plain `python launch/run_cp.py` with world 1
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    groups = CPGroups.create(config, device, timeout_s=args.timeout)
    if rank == 0:
        tokens = sum(n for step in workload.steps for _, n in step)
        print(f"run_cp: pcp={args.pcp} tp={args.tp} dcp={args.dcp} kv_shard={args.kv_shard} "
              f"world={world} device={device} backend={dist.get_backend()}; "
              f"{len(workload.steps)} steps, {tokens} new tokens, {args.dtype}, heads "
              f"{workload.num_heads}/{workload.num_kv_heads}x{workload.head_size}")
    builder_cls = CPAttentionBackend.get_builder_cls(config)
    start = time.perf_counter()
    with step_progress(builder_cls, len(workload.steps), rank == 0 and not args.no_progress):
        report = run_workload(workload, rank, groups,
                              check=args.check)
    wall = time.perf_counter() - start
    summary = {**asdict(report), "wall_s": wall}
    summary.pop("tokens_per_step")
    reports: list = [None] * world
    dist.all_gather_object(reports, summary)
    ok = True
    if args.check:
        tol = TOLERANCE[args.dtype]
        ok = all(r["max_err"] <= tol and r["cache_exact"] and not r["any_nan"] for r in reports)
    if rank == 0:
        print(f"{'rank':>4} {'pcp':>3} {'tp':>3} {'rows':>8} {'KV bytes':>12} {'comm bytes':>12} "
              f"{'attn s':>8} {'wall s':>7} {'max err':>9} cache")
        for r, rep in enumerate(reports):
            pcp_rank, tp_rank = divmod(r, config.tp_size)
            check = (f"{rep['max_err']:>9.2e} {'exact' if rep['cache_exact'] else 'WRONG'}"
                     if args.check else f"{'-':>9} -")
            print(f"{r:>4} {pcp_rank:>3} {tp_rank:>3} {sum(rep['rows_per_step']):>8} "
                  f"{rep['cache_bytes']:>12,} {rep['comm_bytes']:>12,} {rep['seconds']:>8.3f} "
                  f"{rep['wall_s']:>7.2f} {check}")
        if args.check:
            print(f"{'PASS' if ok else 'FAIL'}: float64 oracle, tolerance {TOLERANCE[args.dtype]:g}"
                  f" ({args.dtype}), worst {max(r['max_err'] for r in reports):.2e}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "reports": reports, "ok": ok}, f, indent=2)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
