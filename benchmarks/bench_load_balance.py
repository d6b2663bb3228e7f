"""Load balance of causal prefill work over PCP ranks: head/tail split vs contiguous split.

Planner only (no processes): the head/tail rows of each rank come from
``cp_attention.metadata.pcp.HeadTail``. The causal work of a query row at position p is
the number of keys it sees, p + 1 (pads count 0). A contiguous split gives rank r the tokens
[r L/P, (r+1) L/P). Reported: max/mean of work over ranks (1.0 = perfect balance).

    python -m benchmarks.bench_load_balance --out results/
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.common import (human_tokens, new_figure, parse_args, save_figure, token_ticks,
                               write_json)
from cp_attention.metadata.pcp import HeadTail

NAME = "bench_load_balance"
PCP_SIZES = (2, 3, 4, 6, 8)
PROMPTS = (4096, 16384, 65536, 262144, 1048576)
MIXED_BATCH = (131072, 7, 4097, 65536, 1000, 32768, 3, 16384)  # one step, several prefills


def head_tail_work(new_lens: np.ndarray, pcp: int) -> np.ndarray:
    """[pcp] causal work (keys seen, summed over real query rows) of each rank."""
    work = np.zeros(pcp, dtype=np.float64)
    partition = HeadTail(pcp)
    for rank in range(pcp):
        req, pos = partition.local_rows(partition.chunk_lens(new_lens), rank)
        real = pos < new_lens[req]
        work[rank] = float((pos[real] + 1).sum())
    return work


def contiguous_work(new_lens: np.ndarray, pcp: int) -> np.ndarray:
    """[pcp] causal work when each request is cut into pcp contiguous pieces."""
    work = np.zeros(pcp, dtype=np.float64)
    for length in np.asarray(new_lens, dtype=np.int64):
        bounds = np.linspace(0, length, pcp + 1).round().astype(np.int64)
        lo, hi = bounds[:-1], bounds[1:]
        # sum_{p=lo}^{hi-1} (p+1) = (hi(hi+1) - lo(lo+1)) / 2
        work += (hi * (hi + 1) - lo * (lo + 1)) / 2.0
    return work


def imbalance(work: np.ndarray) -> float:
    return float(work.max() / work.mean())


def run(out_dir: str | Path, quick: bool = False) -> dict:
    pcps = (2, 4) if quick else PCP_SIZES
    prompts = (64, 4096) if quick else PROMPTS
    rows = []
    for pcp in pcps:
        for prompt in prompts:
            lens = np.array([prompt], dtype=np.int64)
            ht, contig = head_tail_work(lens, pcp), contiguous_work(lens, pcp)
            assert abs(ht.sum() - contig.sum()) < 1e-6 * contig.sum(), "work must be conserved"
            rows.append({"pcp": pcp, "prompt": prompt, "head_tail_max_over_mean": imbalance(ht),
                         "contiguous_max_over_mean": imbalance(contig),
                         "contiguous_formula": (2 * pcp - 1) / pcp})
    mixed = np.array(MIXED_BATCH[:3] if quick else MIXED_BATCH, dtype=np.int64)
    mixed_rows = [{"pcp": pcp, "head_tail_max_over_mean": imbalance(head_tail_work(mixed, pcp)),
                   "contiguous_max_over_mean": imbalance(contiguous_work(mixed, pcp))}
                  for pcp in pcps]
    payload = {
        "what": "max/mean over PCP ranks of causal attention work (keys seen per real query row)",
        "source": "planner (HeadTail.local_rows), exact integer work; contiguous = the naive split",
        "rows": rows,
        "mixed_batch": {"prompts": mixed.tolist(), "rows": mixed_rows},
        "worst_head_tail": max(r["head_tail_max_over_mean"] for r in rows),
    }
    write_json(out_dir, NAME, payload)
    _plot(rows, pcps, prompts, out_dir)
    return payload


def _plot(rows, pcps, prompts, out_dir) -> None:
    fig, (ax,) = new_figure()
    for i, pcp in enumerate(pcps):
        mine = [r for r in rows if r["pcp"] == pcp]
        color = f"C{i}"
        ax.plot([r["prompt"] for r in mine], [r["contiguous_max_over_mean"] for r in mine],
                "--o", color=color, label=f"contiguous, pcp={pcp}")
        ax.plot([r["prompt"] for r in mine], [r["head_tail_max_over_mean"] for r in mine],
                "-s", color=color, label=f"head/tail, pcp={pcp}")
    ax.set_xscale("log", base=2)
    token_ticks(ax, prompts)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("max / mean causal work per rank")
    ax.set_title("PCP load balance (1.0 = perfect)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    save_figure(fig, out_dir, NAME)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    payload = run(args.out, args.quick)
    for r in payload["rows"]:
        print(f"pcp={r['pcp']} prompt={human_tokens(r['prompt']):>5}: head/tail "
              f"{r['head_tail_max_over_mean']:.4f}  contiguous {r['contiguous_max_over_mean']:.4f}")
    for r in payload["mixed_batch"]["rows"]:
        print(f"mixed batch pcp={r['pcp']}: head/tail {r['head_tail_max_over_mean']:.4f}  "
              f"contiguous {r['contiguous_max_over_mean']:.4f}")


if __name__ == "__main__":
    main()
