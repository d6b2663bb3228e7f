"""Time to first token of one long prompt through vLLM on CPU: vLLM's CPU_ATTN vs cp_attention.

Configurations, side by side in one run (docs/vllm.md section 4):

* ``cpu_attn_pcp1``: vLLM's own CPU_ATTN backend, 1 process, 1 thread (core 0);
* ``cp_pcp1``: cp_attention through the plugin (``CP_ATTENTION_VLLM=1``), 1 process, 1 thread;
* ``cp_pcp2``: cp_attention with ``prefill_context_parallel_size=2``, 2 worker processes with
  1 thread each (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).

Model: the e2e tests' Llama generator (``tests/vllm_e2e/tiny_model.py``) at a shape where
attention dominates the prefill (2 layers, 8 query heads and 2 KV heads of size 64 on a
256-wide residual, MLP 256, vocabulary 256; random weights, fp32, written to a temp dir).
At 16k tokens attention is about 94% of the prefill FLOPs.

Each configuration is one resident offline ``vllm.LLM`` in its own subprocess (this file with
``--engine``), started one after the other and then driven over a pipe, so the timed requests
of the three configurations are interleaved (same machine load for all). TTFT = wall time of
``LLM.generate`` of one random prompt (no prefix caching, a new prompt every time) with
``max_tokens=1``, prefilled in one step (``max_num_batched_tokens`` >= prompt), after one
untimed warm-up request (of the shortest length); median over repeats. Prefill throughput =
prompt tokens / TTFT.

    python -m benchmarks.bench_vllm_ttft --out results/ [--quick] [--configs cp_pcp1 ...]

Needs the vLLM venv (``pip install -e '.[vllm,bench]'``).
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO_ROOT, human_tokens, new_figure, save_figure, write_json
from benchmarks.engine_process import EngineProcess, engine_env, run_alarm

NAME = "bench_vllm_ttft"
MODEL_SHAPE = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
               "vocab_size": 256, "max_position_embeddings": 32768}
# name -> (extra environment, prefill_context_parallel_size)
CONFIGS = {
    "cpu_attn_pcp1": ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, 1),
    "cp_pcp1": ({"CP_ATTENTION_VLLM": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}, 1),
    "cp_pcp2": ({"CP_ATTENTION_VLLM": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, 2),
}
BASELINE = "cpu_attn_pcp1"
FULL = {"lengths": [8192, 16384], "repeats": 3}
QUICK = {"lengths": [1024, 2048], "repeats": 1}
READY, RESULT = "TTFT_ENGINE_READY", "TTFT_RESULT "
START_TIMEOUT_S = 900  # engine start-up on a loaded 2-core machine
REQUEST_TIMEOUT_S = 900


# -- engine side (a subprocess per configuration) --------------------------------------------
def engine_main(model: str, pcp: int, max_len: int) -> None:
    """Start one LLM, then answer ``<tokens> <seed>`` lines on stdin with one RESULT line each."""
    from vllm import LLM, SamplingParams

    kwargs = dict(model=model, load_format="safetensors", skip_tokenizer_init=True,
                  dtype="float32", seed=0, max_model_len=max_len + 16, max_num_seqs=1,
                  max_num_batched_tokens=max_len + 16, enforce_eager=True,
                  enable_prefix_caching=False, block_size=32)
    if pcp > 1:
        kwargs.update(prefill_context_parallel_size=pcp, distributed_executor_backend="mp")
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        tokens, seed = (int(x) for x in line.split())
        rng = random.Random(seed)
        prompt = {"prompt_token_ids": [rng.randrange(3, MODEL_SHAPE["vocab_size"])
                                       for _ in range(tokens)]}
        cpu0, start = time.process_time(), time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        assert len(out.outputs[0].token_ids) == 1 and len(out.prompt_token_ids) == tokens
        print(RESULT + json.dumps({"tokens": tokens, "ttft_s": wall, "engine_cpu_s": cpu,
                                   "token": int(out.outputs[0].token_ids[0])}), flush=True)


# -- driver side ------------------------------------------------------------------------------
def start_engine(name: str, model: Path, max_len: int, log_dir: Path) -> EngineProcess:
    """Configuration ``name``'s engine, started."""
    extra_env, pcp = CONFIGS[name]
    cmd = [sys.executable, "-m", "benchmarks.bench_vllm_ttft", "--engine", str(model),
           "--pcp", str(pcp), "--max-len", str(max_len)]
    return EngineProcess(name, cmd, engine_env(**extra_env), log_dir / f"{name}.log",
                         ready=READY, result=RESULT, start_timeout_s=START_TIMEOUT_S,
                         request_timeout_s=REQUEST_TIMEOUT_S)


def _ttft(engine: EngineProcess, tokens: int, seed: int) -> dict:
    return engine.request(f"{tokens} {seed}")


def run(out_dir: str | Path, quick: bool = False, configs: list[str] | None = None,
        lengths: list[int] | None = None, repeats: int | None = None) -> dict:
    sizes = QUICK if quick else FULL
    lengths = lengths or sizes["lengths"]
    repeats = repeats or sizes["repeats"]
    configs = configs or list(CONFIGS)
    sys.path.insert(0, str(REPO_ROOT / "tests" / "vllm_e2e"))
    from tiny_model import make_tiny_llama

    run_alarm(NAME, 7200)
    samples: dict[str, dict[int, list[dict]]] = {c: {n: [] for n in lengths} for c in configs}
    engines: dict[str, EngineProcess] = {}
    with tempfile.TemporaryDirectory(prefix="ttft_") as tmp:
        model = make_tiny_llama(Path(tmp) / "model", seed=7, **MODEL_SHAPE)
        try:
            for name in configs:  # one at a time: start-ups never overlap
                engines[name] = start_engine(name, model, max(lengths), Path(tmp))
                print(f"{name}: engine ready in {engines[name].startup_s:.0f} s", flush=True)
            seed = 0
            for name in configs:  # one untimed warm-up request each (the shortest length)
                _ttft(engines[name], lengths[0], seed := seed + 1)
            for rep in range(repeats):
                for n in lengths:
                    order = configs if rep % 2 == 0 else configs[::-1]
                    for name in order:
                        r = _ttft(engines[name], n, seed := seed + 1)
                        samples[name][n].append(r)
                        print(f"  rep {rep} {human_tokens(n):>4} {name:>14}: "
                              f"TTFT {r['ttft_s']:.2f} s", flush=True)
        finally:
            for engine in engines.values():
                engine.close()
            signal.alarm(0)
    results = []
    for name in configs:
        _, pcp = CONFIGS[name]
        for n in lengths:
            ttfts = [s["ttft_s"] for s in samples[name][n]]
            med = statistics.median(ttfts)
            results.append({"config": name, "pcp": pcp, "threads_per_rank": 1, "tokens": n,
                            "ttft_median_s": med, "ttft_min_s": min(ttfts), "ttft_s": ttfts,
                            "prefill_tokens_per_s": n / med,
                            "engine_process_cpu_s": [s["engine_cpu_s"] for s in samples[name][n]],
                            "startup_s": engines[name].startup_s})
    speedups = {}
    if BASELINE in configs:
        base = {r["tokens"]: r["ttft_median_s"] for r in results if r["config"] == BASELINE}
        for r in results:
            r["speedup_vs_cpu_attn"] = base[r["tokens"]] / r["ttft_median_s"]
            speedups.setdefault(r["config"], {})[str(r["tokens"])] = r["speedup_vs_cpu_attn"]
    payload = {"model": MODEL_SHAPE, "dtype": "float32", "lengths": lengths, "repeats": repeats,
               "quick": quick, "configs": {c: {"env": CONFIGS[c][0], "pcp": CONFIGS[c][1]}
                                           for c in configs},
               "speedup_vs_cpu_attn": speedups, "goal": "cp_pcp2 >= 1.6x cpu_attn_pcp1 at 16k",
               "results": results}
    write_json(out_dir, NAME, payload)
    _plot(out_dir, results, configs, lengths)
    return payload


def _plot(out_dir, results, configs, lengths) -> None:
    fig, (ax_t, ax_s) = new_figure(ncols=2, width=5.5)
    width = 0.8 / len(configs)
    for i, name in enumerate(configs):
        rows = [next(r for r in results if r["config"] == name and r["tokens"] == n)
                for n in lengths]
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(lengths))]
        bars = ax_t.bar(xs, [r["ttft_median_s"] for r in rows], width, label=name)
        if "speedup_vs_cpu_attn" in rows[0]:
            ax_t.bar_label(bars, [f"{r['speedup_vs_cpu_attn']:.2f}x" for r in rows], fontsize=7)
        ax_s.plot(lengths, [r["prefill_tokens_per_s"] for r in rows], marker="o", label=name)
    ax_t.set_xticks(range(len(lengths)), [human_tokens(n) for n in lengths])
    ax_t.set_xlabel("prompt tokens")
    ax_t.set_ylabel("TTFT, median (s)")
    ax_t.set_title("vLLM CPU time to first token (labels: speedup vs CPU_ATTN)", fontsize=9)
    ax_t.legend(fontsize=8)
    ax_s.set_xscale("log", base=2)
    ax_s.set_xticks(lengths, [human_tokens(n) for n in lengths])
    ax_s.set_xlabel("prompt tokens")
    ax_s.set_ylabel("prefill tokens / s")
    ax_s.set_title("prefill throughput (1 thread per rank)", fontsize=9)
    ax_s.legend(fontsize=8)
    save_figure(fig, out_dir, NAME)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="short prompts, 1 repeat")
    parser.add_argument("--configs", nargs="*", choices=list(CONFIGS), default=None)
    parser.add_argument("--lengths", nargs="*", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine
    parser.add_argument("--pcp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--max-len", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        engine_main(args.engine, args.pcp, args.max_len)
        return
    payload = run(args.out, args.quick, args.configs, args.lengths, args.repeats)
    for config, by_len in payload["speedup_vs_cpu_attn"].items():
        print(config, {human_tokens(int(n)): f"{s:.2f}x" for n, s in by_len.items()})


if __name__ == "__main__":
    main()
