"""Nightly planner fuzzing: random steps through every rank's metadata builder.

Usage: PYTHONPATH=. python benchmarks/fuzz_nightly.py --examples 10000 [--seed 0]
Each example draws a config (pcp 1..8, dcp 1/2/4, block size, interleave, kv_shard,
spec-decode threshold), a batch of decodes / prefills / chunked prefills and an optional
sliding window, builds the metadata of every (pcp_rank, dcp_rank) and checks
:func:`cp_attention.metadata.checks.validate_rank_plans`. Prints a summary; exit status 1 on any
failure (each failure is printed with the example seed that reproduces it).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_fuzz_planners import check_case  # noqa: E402  (the CI fuzzer's builder + checker)

from cp_attention.config import CPConfig  # noqa: E402


def random_case(rng: np.random.Generator):
    """One (config, requests, window, extra_cols, seed) example."""
    pcp = int(rng.integers(1, 9))
    dcp = int(rng.choice([1, 2, 4]))
    block = int(rng.choice([2, 4, 8, 16, 32, 64]))
    inter = int(rng.choice([i for i in (1, 2, 4, 8, 16) if block % i == 0]))
    threshold = int(rng.integers(1, 4))
    config = CPConfig(pcp_size=pcp, dcp_size=dcp, tp_size=dcp, block_size=block,
                      cp_kv_interleave_size=inter, kv_shard=str(rng.choice(["cp", "dcp"])),
                      decode_threshold=threshold)
    requests = []
    for _ in range(int(rng.integers(1, 9))):
        kind = rng.integers(3)
        if kind == 0:
            requests.append((int(rng.integers(1, 2000)), int(rng.integers(1, threshold + 1))))
        elif kind == 1:
            requests.append((0, int(rng.integers(1, 300))))
        else:
            requests.append((int(rng.integers(1, 2000)), int(rng.integers(threshold + 1, 300))))
    requests.sort(key=lambda r: not (r[0] > 0 and r[1] <= threshold))
    window = None if rng.random() < 0.5 else int(rng.integers(1, 512))
    return config, requests, window, int(rng.integers(0, 3)), int(rng.integers(2 ** 16))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-failures", type=int, default=10)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    failures: list[str] = []
    states = collections.Counter()
    ranks_built = tokens = 0
    for i in range(args.examples):
        rng = np.random.default_rng([args.seed, i])
        case = random_case(rng)
        config, requests = case[0], case[1]
        states[f"pcp{config.pcp_size}"] += 1
        ranks_built += config.pcp_size * config.dcp_size
        tokens += sum(s for _, s in requests)
        try:
            check_case(*case)
        except Exception as exc:  # report and go on
            failures.append(f"example {i} (--seed {args.seed}): {config} {requests} "
                            f"window={case[2]}: {type(exc).__name__}: {exc}")
            if len(failures) >= args.max_failures:
                break
    seconds = time.perf_counter() - start
    done = i + 1
    print(f"fuzz_nightly: {done} examples, {ranks_built} rank plans, {tokens} step tokens, "
          f"{len(failures)} failures, {seconds:.1f} s ({1e3 * seconds / done:.2f} ms/example)")
    print("examples per pcp size:", dict(sorted(states.items())))
    for line in failures:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
