"""Run every benchmark in order (bench_speed before bench_cost_model, which validates on it).

    python -m benchmarks.run_all --out results/ [--quick] [--only bench_comm bench_speed]
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO_ROOT

ORDER = ("bench_load_balance", "bench_comm", "bench_speed", "bench_metadata",
         "bench_op_overhead", "bench_forward_checks", "bench_cost_model")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO_ROOT / "results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", choices=ORDER, default=None)
    args = parser.parse_args(argv)
    for name in args.only or ORDER:
        start = time.perf_counter()
        importlib.import_module(f"benchmarks.{name}").run(args.out, args.quick)
        print(f"{name}: {time.perf_counter() - start:.1f} s -> {args.out}/{name}.json")


if __name__ == "__main__":
    main()
