"""Communication bytes per rank: PCP prefill vs the all-gather lower bound, decode vs context.

Two sources, labelled in the JSON:
  * ``measured``: the bytes :class:`cp_attention.comm.Communicator` counted on a real run of
    4 gloo ranks (one layer, fp32, small prompts), compared with the formula for the same
    shapes (they must agree exactly) and with the lower bound ``(N-1)/N x KV bytes``;
  * ``formula``: ``cp_attention.costmodel`` byte formulas at large sizes (llama3-70b shape,
    bf16, tp=8, per layer): prefill 4k..1M tokens and decode context 1k..1M, next to what
    gathering the sharded context every step would cost;
  * ``window``: a sliding-window layer's PCP exchange (the planner's rows, ``metadata/
    window.py``) against the all-gather's, for the Gemma 3 270M shape (1 KV head of 256,
    window 512) and a GPT-OSS shape (8 KV heads of 64, window 128), prompts 8k..128k, both
    KV-shard policies and both window caches; measured on 4 gloo ranks (pcp=2 x tp=2).

    python -m benchmarks.bench_comm --out results/
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (human_tokens, new_figure, parse_args, save_figure, series_colors,
                               token_ticks, write_json)
from cp_attention import costmodel
from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.builder import MetadataBuilder
from cp_attention.metadata.common import StepSpec
from cp_attention.testing.pool import RankPool
from cp_attention.testing.workload import Workload

NAME = "bench_comm"
WORLD = 4
# (pcp, tp, dcp, num_kv_heads) on 4 ranks; num_heads = 8, head_size = 32, fp32
REAL_CONFIGS = ((4, 1, 1, 2), (2, 2, 1, 2), (2, 2, 2, 1), (1, 4, 2, 1), (1, 4, 4, 1))
BIG_MODEL = "llama3-70b"
# (name, KV heads per rank, head size, window): the window layers of real hybrid models
WINDOW_SHAPES = (("gemma3-270m", 1, 256, 512), ("gpt-oss", 8, 64, 128))


def window_exchange_rows(tokens: int, pcp: int, window: int, kv_shard: str,
                         window_cache: str) -> tuple[int, int]:
    """(rows each rank sends in the window exchange, in the all-gather) for one prompt."""
    cfg = CPConfig(pcp_size=pcp, kv_shard=kv_shard, window_cache=window_cache, block_size=128)
    blocks = -(-tokens // (cfg.block_size * cfg.kv_world))
    step = StepSpec((0,), (tokens,), torch.arange(blocks, dtype=torch.int32)[None])
    meta = MetadataBuilder(cfg, CPRanks(), sliding_window=window).build(step)
    return len(meta.window_send_idx), meta.num_local_prefill_rows


def formula_window(prompts, pcps) -> list[dict]:
    """Window exchange vs all-gather bytes per rank per layer (bf16), from the planner."""
    rows = []
    for name, kv_heads, head_size, window in WINDOW_SHAPES:
        for pcp in pcps:
            for kv_shard in ("cp", "dcp"):
                for cache in ("all", "window"):
                    for tokens in prompts:
                        sent, local = window_exchange_rows(tokens, pcp, window, kv_shard, cache)
                        row_bytes = (pcp - 1) * 2 * kv_heads * head_size * 2  # K and V, bf16
                        rows.append({"model": name, "window": window, "pcp": pcp,
                                     "kv_shard": kv_shard, "window_cache": cache,
                                     "prompt": tokens, "window_bytes": sent * row_bytes,
                                     "all_gather_bytes": local * row_bytes,
                                     "ratio": sent / local})
    return rows


def measured_window(prompt: int, pool: RankPool) -> list[dict]:
    """Communicator bytes of a window layer's prefill on 4 gloo ranks (pcp=2 x tp=2, the KV
    heads split or replicated over tp) vs the planner's."""
    rows = []
    pcp, tp = 2, 2
    for name, kv_heads, head_size, window in WINDOW_SHAPES:
        kv_per_rank = max(1, kv_heads // tp)
        for kv_shard, cache in (("cp", "all"), ("cp", "window"), ("dcp", "window")):
            cfg = CPConfig(pcp_size=pcp, tp_size=tp, kv_shard=kv_shard, window_cache=cache,
                           block_size=128)
            w = Workload(cfg, (((0, prompt),), ((0, 1),)), num_heads=max(tp, kv_heads),
                         num_kv_heads=kv_heads, head_size=head_size, sliding_window=window)
            reports = pool.run("cp_attention.testing.workload.run_workload_task", w,
                               timeout_s=300)
            sent, local = window_exchange_rows(prompt, pcp, window, kv_shard, cache)
            row_bytes = (pcp - 1) * 2 * kv_per_rank * head_size * 4  # fp32
            rows.append({"model": name, "pcp": pcp, "tp": tp, "kv_shard": kv_shard,
                         "window_cache": cache, "prompt": prompt,
                         "bytes_measured_per_rank": [r.comm_bytes_per_step[0] for r in reports],
                         "bytes_planned": sent * row_bytes,
                         "all_gather_bytes": local * row_bytes,
                         "max_err_vs_fp64": max(r.max_err for r in reports),
                         "cache_exact": all(r.cache_exact for r in reports)})
    return rows


def real_runs(prompts: tuple[int, int], decode_steps: int, pool: RankPool) -> list[dict]:
    """Run prefill (two prompts) + decode steps on every config; bytes per rank and step."""
    rows = []
    heads, head_size = 8, 32
    for pcp, tp, dcp, kv_heads in REAL_CONFIGS:
        cfg = CPConfig(pcp_size=pcp, tp_size=tp, dcp_size=dcp, block_size=16)
        steps = (((0, prompts[0]), (1, prompts[1])),) + (((0, 1), (1, 1)),) * decode_steps
        w = Workload(cfg, steps, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size)
        reports = pool.run("cp_attention.testing.workload.run_workload_task", w, timeout_s=300)
        model = costmodel.ModelShape(1, heads, kv_heads, head_size, dtype_bytes=4)
        pre_formula = sum(costmodel.prefill_comm_bytes(model, p, pcp, tp) for p in prompts)
        pre_bound = sum(costmodel.prefill_comm_lower_bound(model, p, pcp, tp) for p in prompts)
        dec_formula = costmodel.decode_comm_bytes(model, 2, pcp, tp, dcp)
        pre_measured = [r.comm_bytes_per_step[0] for r in reports]
        dec_measured = [r.comm_bytes_per_step[1] for r in reports]
        rows.append({
            "pcp": pcp, "tp": tp, "dcp": dcp, "num_heads": heads, "num_kv_heads": kv_heads,
            "head_size": head_size, "dtype": "float32", "prompts": list(prompts),
            "prefill_bytes_measured_per_rank": pre_measured,
            "prefill_bytes_formula": pre_formula,
            "prefill_lower_bound": pre_bound,
            "prefill_over_bound": (max(pre_measured) / pre_bound) if pre_bound else None,
            "decode_bytes_measured_per_rank": dec_measured,
            "decode_bytes_formula": dec_formula,
            "formula_matches": (all(m == pre_formula for m in pre_measured)
                                and all(m == dec_formula for m in dec_measured)),
            "max_err_vs_fp64": max(r.max_err for r in reports),
            "cache_exact": all(r.cache_exact for r in reports),
        })
    return rows


def formula_prefill(prompts, pcps) -> list[dict]:
    model, tp = costmodel.MODELS[BIG_MODEL], 8
    return [{"pcp": pcp, "prompt": p,
             "bytes_per_layer": costmodel.prefill_comm_bytes(model, p, pcp, tp),
             "lower_bound": costmodel.prefill_comm_lower_bound(model, p, pcp, tp),
             "over_bound": costmodel.prefill_comm_bytes(model, p, pcp, tp)
             / costmodel.prefill_comm_lower_bound(model, p, pcp, tp)}
            for pcp in pcps for p in prompts]


def formula_decode(contexts, combos, batch: int = 1) -> list[dict]:
    model = costmodel.MODELS["mla-671b"]  # one KV head: DCP is allowed at tp=8
    tp = 8
    rows = []
    for pcp, dcp in combos:
        for ctx in contexts:
            rows.append({"pcp": pcp, "dcp": dcp, "context": ctx, "batch": batch,
                         "bytes_per_layer": costmodel.decode_comm_bytes(model, batch, pcp, tp, dcp),
                         "collectives_per_layer": costmodel.decode_collectives(pcp, dcp),
                         "naive_context_gather_bytes": costmodel.naive_context_gather_bytes(
                             model, ctx, pcp * dcp, tp)})
    return rows


def run(out_dir: str | Path, quick: bool = False) -> dict:
    prompts = (40, 13) if quick else (1000, 333)
    with RankPool(WORLD) as pool:
        real = real_runs(prompts, 1 if quick else 2, pool)
        window_real = measured_window(1000 if quick else 4000, pool)
    big_prompts = (4096, 65536) if quick else (4096, 16384, 65536, 262144, 1048576)
    contexts = (1024, 65536) if quick else (1024, 4096, 16384, 65536, 262144, 1048576)
    payload = {
        "measured": {"source": "Communicator byte counts of a real 4-rank gloo run (one layer, "
                               "ring accounting: all-gather (w-1) x input, reduce-scatter and "
                               "all-to-all (w-1)/w x input)", "rows": real},
        "formula_prefill": {"source": f"cp_attention.costmodel formula, {BIG_MODEL}, bf16, tp=8,"
                                       " bytes per rank per layer", "rows":
                            formula_prefill(big_prompts, (2, 4, 8))},
        "formula_decode": {"source": "cp_attention.costmodel formula, mla-671b shape (1 KV head), "
                                     "bf16, tp=8, batch 1, bytes per rank per layer; naive = "
                                     "gather the sharded context", "rows":
                           formula_decode(contexts, ((1, 2), (1, 4), (1, 8), (2, 1), (2, 8),
                                                     (4, 8)))},
    }
    payload["window"] = {
        "source": "rows of the window exchange (MetadataBuilder with sliding_window) vs the "
                  "all-gather's local rows, K and V in bf16, bytes sent per rank per layer "
                  "(ring accounting); window_cache 'all' writes every token of the shard, "
                  "'window' only each prefill's last window - 1",
        "rows": formula_window((8192, 32768) if quick else (8192, 16384, 32768, 131072),
                               (2, 4)),
        "measured": window_real}
    payload["all_formulas_match_measurement"] = all(r["formula_matches"] for r in real) and all(
        set(r["bytes_measured_per_rank"]) == {r["bytes_planned"]} for r in window_real)
    write_json(out_dir, NAME, payload)
    _plot(payload, out_dir)
    return payload


def _plot(payload, out_dir) -> None:
    fig, (ax1, ax2) = new_figure(2)
    rows = payload["formula_prefill"]["rows"]
    prefill_pcps = sorted({r["pcp"] for r in rows})
    combos = sorted({(r["pcp"], r["dcp"]) for r in payload["formula_decode"]["rows"]})
    colors = series_colors([(pcp, 1) for pcp in prefill_pcps] + combos)  # (pcp, dcp): both panels
    for pcp in prefill_pcps:
        mine = [r for r in rows if r["pcp"] == pcp]
        x = [r["prompt"] for r in mine]
        ax1.plot(x, [r["bytes_per_layer"] / 2**20 for r in mine], "-o", color=colors[(pcp, 1)],
                 label=f"pcp={pcp} (formula)")
        ax1.plot(x, [r["lower_bound"] / 2**20 for r in mine], ":", color=colors[(pcp, 1)],
                 label=f"pcp={pcp} bound (N-1)/N KV (coincides)")
    measured = [r for r in payload["measured"]["rows"] if r["pcp"] > 1]
    for i, r in enumerate(measured):
        ax1.annotate(f"measured (4 gloo ranks, {sum(r['prompts'])} tok) pcp={r['pcp']} tp={r['tp']} "
                     f"dcp={r['dcp']}: x{r['prefill_over_bound']:.4f} of bound",
                     xy=(0.02, 0.95 - 0.05 * i), xycoords="axes fraction", fontsize=7)
    ax1.set(xscale="log", yscale="log", xlabel="prompt tokens",
            ylabel="MiB sent per rank per layer", title=f"PCP prefill K/V all-gather ({BIG_MODEL}, tp=8)")
    token_ticks(ax1, sorted({r["prompt"] for r in rows}))
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    rows = payload["formula_decode"]["rows"]
    for pcp, dcp in combos:
        mine = [r for r in rows if (r["pcp"], r["dcp"]) == (pcp, dcp)]
        x = [r["context"] for r in mine]
        color = colors[(pcp, dcp)]
        ax2.plot(x, [r["bytes_per_layer"] / 1024 for r in mine], "-o", color=color,
                 label=f"pcp={pcp} dcp={dcp}: CP decode")
        ax2.plot(x, [r["naive_context_gather_bytes"] / 1024 for r in mine], ":", color=color)
    ax2.plot([], [], "k:", label="dotted: gather the context instead")
    ax2.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="KiB sent per rank per layer",
            title="decode step, batch 1 (mla-671b shape, tp=8)")
    token_ticks(ax2, sorted({r["context"] for r in rows}))
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    save_figure(fig, out_dir, NAME)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    payload = run(args.out, args.quick)
    for r in payload["measured"]["rows"]:
        print(f"measured pcp={r['pcp']} tp={r['tp']} dcp={r['dcp']}: prefill "
              f"{max(r['prefill_bytes_measured_per_rank'])} B (formula {r['prefill_bytes_formula']},"
              f" bound {r['prefill_lower_bound']:.0f}, x{r['prefill_over_bound'] or 0:.4f}); decode "
              f"{max(r['decode_bytes_measured_per_rank'])} B (formula {r['decode_bytes_formula']}); "
              f"match={r['formula_matches']} err={r['max_err_vs_fp64']:.1e}")
    for r in payload["window"]["measured"]:
        print(f"window {r['model']} pcp={r['pcp']} tp={r['tp']} {r['kv_shard']}/"
              f"{r['window_cache']}: measured {r['bytes_measured_per_rank']} B, planned {r['bytes_planned']}, "
              f"all-gather {r['all_gather_bytes']} err={r['max_err_vs_fp64']:.1e}")
    for r in payload["window"]["rows"]:
        if r["prompt"] == 32768:
            print(f"window {r['model']} pcp={r['pcp']} {r['kv_shard']}/{r['window_cache']} 32k: "
                  f"{r['ratio']:.4f} of the all-gather's bytes")
    for r in payload["formula_prefill"]["rows"]:
        print(f"formula pcp={r['pcp']} prompt={human_tokens(r['prompt'])}: x{r['over_bound']:.5f} of bound")


if __name__ == "__main__":
    main()
