"""Run the benchmarks in order, then write their results pages (``results/<name>.md``).

    python -m benchmarks.run_all [--out results/] [--quick] [--only bench_comm bench_speed ...]
    python -m benchmarks.run_all --pages-only [--out results/]   # pages from the JSON there
    python -m benchmarks.run_all --list

``bench_speed`` runs before ``bench_cost_model`` (which validates on its JSON in the same
folder). ``--quick`` gives every benchmark its smoke-test sizes and, unless ``--out`` is given,
writes to a new temporary folder, so that a smoke run never replaces the measured runs in
``results/``. ``bench_vllm_ttft``, ``bench_vllm_real`` and ``bench_vllm_load`` start vLLM
engines: they run only where this interpreter can import vLLM (the vLLM venv,
``pip install -e '.[vllm,bench]'``);
elsewhere they are reported as not run, nothing is written for them, and the exit status is 1
if they were asked for with ``--only``. ``bench_cpu_ops`` and ``bench_prefill_kernel`` leave
the vLLM column out where vLLM is missing (their JSON says so).
"""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO_ROOT


@dataclass(frozen=True)
class Bench:
    name: str                 # what --only takes; the JSON is <out>/<json>.json
    module: str               # benchmarks.<module>
    function: str = "run"     # called as function(out_dir, quick, **kwargs)
    kwargs: dict = field(default_factory=dict)
    needs_vllm: bool = False  # cannot run at all without vLLM


BENCHMARKS = (
    Bench("bench_load_balance", "bench_load_balance"),
    Bench("bench_comm", "bench_comm"),
    Bench("bench_speed", "bench_speed"),
    Bench("bench_metadata", "bench_metadata"),
    Bench("bench_op_overhead", "bench_op_overhead"),
    Bench("bench_forward_checks", "bench_forward_checks"),
    Bench("bench_cost_model", "bench_cost_model"),  # after bench_speed: reads its JSON
    Bench("bench_pcp_kv_memory", "bench_pcp_kv_memory"),
    Bench("bench_cpu_ops", "bench_cpu_ops"),
    # bench_cpu_ops --matrix, with the K/V limit of the committed run (results/bench_cpu_matrix.md)
    Bench("bench_cpu_matrix", "bench_cpu_ops", "run_matrix", {"max_kv_gib": 0.5}),
    # bench_cpu_ops --model-shapes: Gemma 3's attention shapes, caches flushed
    Bench("bench_cpu_model_shapes", "bench_cpu_ops", "run_model_shapes"),
    Bench("bench_prefill_kernel", "bench_prefill_kernel"),
    Bench("bench_vllm_ttft", "bench_vllm_ttft", needs_vllm=True),
    Bench("bench_vllm_real", "bench_vllm_real", needs_vllm=True),
    Bench("bench_vllm_load", "bench_vllm_load", needs_vllm=True),
)
ORDER = tuple(b.name for b in BENCHMARKS)


def vllm_importable() -> tuple[bool, str]:
    """Whether this interpreter imports vLLM (checked in a child process, so this one stays
    free of it), and the last line of the error if not."""
    try:
        proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True,
                              text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False, "`import vllm` took over 10 minutes"
    if proc.returncode == 0:
        return True, ""
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return False, lines[-1] if lines else f"exit status {proc.returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="results folder (default results/; with --quick a new temp folder)")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes")
    parser.add_argument("--only", nargs="*", choices=ORDER, default=None)
    parser.add_argument("--pages-only", action="store_true",
                        help="run nothing: write the results pages from the JSON in --out")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    from benchmarks import pages

    if args.list:
        for b in BENCHMARKS:
            call = f"{b.module}.{b.function}" + (f" {b.kwargs}" if b.kwargs else "")
            print(f"{b.name:<22} {call}{'  (needs vLLM)' if b.needs_vllm else ''}")
        return 0
    if args.out is None:
        args.out = (tempfile.mkdtemp(prefix="cp_attention_quick_") if args.quick and not
                    args.pages_only else str(REPO_ROOT / "results"))
    if args.pages_only:
        for path in pages.write_pages(args.out, args.only):
            print(f"wrote {path}")
        return 0

    wanted = [b for b in BENCHMARKS if args.only is None or b.name in args.only]
    vllm_ok, vllm_why = (vllm_importable() if any(b.needs_vllm for b in wanted)
                         else (True, ""))
    ran, not_run = [], []
    for b in wanted:
        if b.needs_vllm and not vllm_ok:
            not_run.append(b.name)
            print(f"{b.name}: NOT RUN: vLLM is not importable by {sys.executable} "
                  f"({vllm_why}); run it in the vLLM venv, e.g. `PYTHONPATH=$PWD "
                  f".venv-vllm/bin/python -m benchmarks.run_all --only {b.name}`. "
                  f"Nothing was written for it.", flush=True)
            continue
        start = time.perf_counter()
        module = importlib.import_module(f"benchmarks.{b.module}")
        getattr(module, b.function)(args.out, args.quick, **b.kwargs)
        ran.append(b.name)
        print(f"{b.name}: {time.perf_counter() - start:.1f} s -> {args.out}/{b.name}.json",
              flush=True)
    for path in pages.write_pages(args.out, ran):
        print(f"wrote {path}")
    if not_run:
        print(f"not run (no vLLM here): {', '.join(not_run)}")
    return 1 if not_run and args.only is not None else 0


if __name__ == "__main__":
    sys.exit(main())
