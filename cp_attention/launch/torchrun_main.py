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

The world must be ``pcp * tp`` processes (rank = pcp_rank * tp + tp_rank). Each rank runs on
the device ``--device`` names (``auto``: NPU, else CUDA, else CPU; an accelerator only when every
rank of the node gets its own, see :mod:`cp_attention.launch.device`) with that device's ops
(``get_ops(device)``) and collective backend (gloo on CPU, nccl on CUDA, hccl on NPU); the
output and the JSON report say which ops, device and backend ran. With ``--check`` every rank
compares each of its output rows with the float64 oracle (on the CPU) and checks its KV-cache
shard exactly; the exit status is 1 if any rank fails.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from tqdm import tqdm

from cp_attention.config import CPConfig
from cp_attention.launch.device import DEVICE_CHOICES, DeviceUnavailableError, select_device
from cp_attention.parallel import CPGroups
from cp_attention.testing.workload import ORACLE_TOLERANCE, Workload, run_workload


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
    parser.add_argument("--dtype", default="float32", choices=sorted(ORACLE_TOLERANCE))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--interleave", type=int, default=1, help="cp_kv_interleave_size")
    parser.add_argument("--kv-shard", default="cp", choices=["cp", "dcp"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with the float64 oracle")
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                        help="auto: npu, else cuda, else cpu (an accelerator only with one device "
                        "per local rank); cuda/npu: that device or an error")
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


def progress_bar(total: int, enabled: bool):
    """A tqdm bar on stderr, advanced once per step (``on_step`` of run_workload)."""
    return tqdm(total=total, desc="steps", unit="step", disable=not enabled, file=sys.stderr)


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
    try:
        choice = select_device(args.device)
    except DeviceUnavailableError as exc:
        raise SystemExit(f"run_cp: {exc}") from None
    if choice.note and rank == 0:
        print(f"note: {choice.note}", file=sys.stderr)
    if "MASTER_ADDR" not in os.environ:  # plain `python launch/run_cp.py` with world 1
        # port 0: the OS picks a free one (nobody else joins a world of one)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    groups = CPGroups.create(config, choice.device, timeout_s=args.timeout)
    if rank == 0:
        tokens = sum(n for step in workload.steps for _, n in step)
        print(f"run_cp: pcp={args.pcp} tp={args.tp} dcp={args.dcp} kv_shard={args.kv_shard} "
              f"world={world} device={choice.device.type} backend={dist.get_backend()}; "
              f"{len(workload.steps)} steps, {tokens} new tokens, {args.dtype}, heads "
              f"{workload.num_heads}/{workload.num_kv_heads}x{workload.head_size}")
    start = time.perf_counter()
    with progress_bar(len(workload.steps), rank == 0 and not args.no_progress) as bar:
        report = run_workload(workload, rank, groups, check=args.check, device=choice.device,
                              on_step=lambda _: bar.update(1))
    wall = time.perf_counter() - start
    # torchrun's GROUP_RANK is the node (agent) this rank runs on
    summary = {**asdict(report), "wall_s": wall, "node": int(os.environ.get("GROUP_RANK", "0")),
               "host": socket.gethostname()}
    summary.pop("tokens_per_step")
    reports: list = [None] * world
    dist.all_gather_object(reports, summary)
    ok = True
    if args.check:
        tol = ORACLE_TOLERANCE[args.dtype]
        ok = all(r["max_err"] <= tol and r["cache_exact"] and not r["any_nan"] for r in reports)
    if rank == 0:
        print(f"{'rank':>4} {'node':>4} {'pcp':>3} {'tp':>3} {'device':>7} {'ops':>13} {'rows':>8} "
              f"{'KV bytes':>12} {'comm bytes':>12} {'attn s':>8} {'wall s':>7} {'max err':>9} "
              "cache")
        for r, rep in enumerate(reports):
            pcp_rank, tp_rank = divmod(r, config.tp_size)
            check = (f"{rep['max_err']:>9.2e} {'exact' if rep['cache_exact'] else 'WRONG'}"
                     if args.check else f"{'-':>9} -")
            print(f"{r:>4} {rep['node']:>4} {pcp_rank:>3} {tp_rank:>3} {rep['device']:>7} {rep['ops']:>13} "
                  f"{sum(rep['rows_per_step']):>8} "
                  f"{rep['cache_bytes']:>12,} {rep['comm_bytes']:>12,} {rep['seconds']:>8.3f} "
                  f"{rep['wall_s']:>7.2f} {check}")
        if args.check:
            print(f"{'PASS' if ok else 'FAIL'}: float64 oracle, tolerance {tol:g}"
                  f" ({args.dtype}), worst {max(r['max_err'] for r in reports):.2e}")
        nodes = sorted({r["node"] for r in reports})
        print(f"nodes: {len(nodes)} (" + "; ".join(
            f"node {n}: ranks {[r for r, rep in enumerate(reports) if rep['node'] == n]}"
            for n in nodes) + ")")
        ran = sorted({(r["ops"], r["device"].split(":")[0], r["backend"]) for r in reports})
        print("ran: " + "; ".join(f"{ops} on {dev} over {backend}" for ops, dev, backend in ran))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "device_note": choice.note,
                           "ran": [dict(ops=o, device=d, backend=b) for o, d, b in ran],
                           "reports": reports, "ok": ok}, f, indent=2)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
