"""``cp-attn``: the CP demo on local CPU processes over gloo.

Runs a multi-step workload (long prompts, a prompt continued over cached context, chunked
prefill, decodes) on pcp x tp ranks and prints, per rank, tokens computed, KV bytes held,
bytes communicated, time and the largest error against the float64 reference; the same
workload on one device is run for comparison.
"""
from __future__ import annotations

import argparse
import time

from cp_attention.config import CPConfig
from cp_attention.testing.pool import RankPool
from cp_attention.testing.workload import Workload, run_workload


def demo_workload(config: CPConfig, prompt: int, dtype: str) -> Workload:
    """Two long prompts and a short one; then a prefix-hit continuation, a chunked prefill,
    and decodes mixed with prefill chunks."""
    steps = [
        ((0, prompt), (1, prompt // 2), (2, 7)),  # prefill, no cache
        ((0, 1), (1, 1), (2, 1)),  # decode only
        ((2, prompt // 4),),  # prefix hit: new tokens over cached context
        ((0, 1), (1, 1), (3, prompt // 2)),  # decodes + first chunk of a chunked prefill
        ((0, 1), (1, 1), (3, prompt // 2)),  # decodes + second chunk
    ] + [((0, 1), (1, 1), (2, 1), (3, 1))] * 4
    return Workload(config, tuple(steps), num_heads=8, num_kv_heads=1, head_size=64, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pcp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dcp", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=2048, help="tokens of the longest prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    config = CPConfig(pcp_size=args.pcp, tp_size=args.tp, dcp_size=args.dcp,
                      block_size=args.block_size, cp_kv_interleave_size=args.interleave)
    workload = demo_workload(config, args.prompt, args.dtype)
    total_new = sum(n for step in workload.steps for _, n in step)
    print(f"cp_attention demo: pcp={args.pcp} tp={args.tp} dcp={args.dcp} on "
          f"{config.world_size} local CPU processes (gloo); {len(workload.steps)} steps, "
          f"{total_new} new tokens, {args.dtype}")
    start = time.perf_counter()
    with RankPool(config.world_size) as pool:
        reports = pool.run("cp_attention.testing.workload.run_workload_task", workload,
                           timeout_s=600)
    wall = time.perf_counter() - start
    single = run_workload(Workload(CPConfig(block_size=args.block_size), workload.steps,
                                   num_heads=8, num_kv_heads=1, head_size=64, dtype=args.dtype))
    print(f"{'rank':>4} {'pcp':>3} {'tp':>3} {'tokens':>8} {'KV bytes':>12} {'comm bytes':>12} "
          f"{'attn s':>8} {'max err':>9} cache")
    for rank, rep in enumerate(reports):
        pcp_rank, tp_rank = divmod(rank, config.tp_size)
        tokens = sum(len(t) for t in rep.tokens_per_step)
        print(f"{rank:>4} {pcp_rank:>3} {tp_rank:>3} {tokens:>8} {rep.cache_bytes:>12,} "
              f"{rep.comm_bytes:>12,} {rep.seconds:>8.3f} {rep.max_err:>9.2e} "
              f"{'exact' if rep.cache_exact else 'WRONG'}")
    print(f"single device: KV bytes {single.cache_bytes:,}, attn {single.seconds:.3f} s, "
          f"max err {single.max_err:.2e}")
    worst = max(r.max_err for r in reports)
    ok = all(r.cache_exact and not r.any_nan for r in reports) and worst <= 3 * single.max_err + 1e-6
    print(f"{'OK' if ok else 'MISMATCH'}: worst CP error {worst:.2e} vs single-device "
          f"{single.max_err:.2e} (wall {wall:.1f} s incl. process start)")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
