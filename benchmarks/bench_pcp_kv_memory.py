"""K/V bytes one pcp=2 prefill layer materializes, and its peak extra memory, with the unmasked
part gathering copies (``k_pre[kv_nomask_idx]``, before) and reading a prefix of the restored
K/V in place (``varlen_attention(..., seqused_k=...)``, after).

One prefill of S tokens (default 32k), (Hq, Hkv) = (8, 8), head size 128, bf16, one layer, on
2 gloo ranks of a :class:`RankPool` (1 thread each, a fresh pool per variant so no heap is
reused across variants). Per rank and variant, one layer forward:

* ``kv_bytes_materialized``: bytes of the K/V arguments of every ``varlen_attention`` call
  that are copies, i.e. share no storage with the restored step K/V or with the layer's own
  key/value inputs, split into the unmasked part (``causal=False``), the diagonal and the
  sliding-window calls;
* ``peak_extra_bytes``: the process's peak resident memory during the forward (``VmHWM``
  after ``echo 5 > /proc/self/clear_refs``) minus its resident memory before it: every
  allocation of the forward (all-gather buffers, restored K/V, outputs, copies), Linux only;
  ``stages``: resident and peak memory (above the same base) right after the K/V all-gather
  is restored and after each ``varlen_attention`` call, to see
  where the peak is.

The "before" variant is the unmasked part as it was before ``seqused_k`` (kept here,
monkeypatched into the impl), so both come from one commit:

    python -m benchmarks.bench_pcp_kv_memory --out results/ [--tokens 32768] [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.common import REPO_ROOT, write_json
from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig
from cp_attention.impl import self_part
from cp_attention.metadata.common import StepSpec, ranges_concat
from cp_attention.metadata.kv_layout import KVSharding
from cp_attention.testing.pool import RankPool

NAME = "bench_pcp_kv_memory"
HQ, HKV, HEAD_SIZE, DTYPE = 8, 8, 128, torch.bfloat16


def _gathering_chunk_attention(ops, q_part, k_pre, v_pre, cu_q, restored_cu, keys_before,
                               scale):
    """The unmasked part before seqused_k: gathered copies of the keys before the chunk."""
    idx = torch.from_numpy(ranges_concat(restored_cu[:-1].numpy(), keys_before.numpy()))
    idx = idx.to(q_part.device)
    return ops.varlen_attention(q_part, k_pre[idx], v_pre[idx], cu_q, cumsum0_t(keys_before),
                                scale=scale, causal=False)


def cumsum0_t(lengths: torch.Tensor) -> torch.Tensor:
    """[n + 1] 0, then the running sums of ``lengths`` [n]."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _layer(groups, cfg: CPConfig, tokens: int, seed: int):
    """One rank's layer, metadata, inputs, KV cache and output for a ``tokens`` prefill."""
    num_blocks = int(KVSharding.of(cfg).blocks_needed(np.array([tokens]))[0]) + 1
    builder = CPAttentionBackend.get_builder_cls()(cfg, groups.ranks, None, num_blocks)
    impl = CPAttentionBackend.get_impl_cls(cfg)(HQ, HEAD_SIZE, HEAD_SIZE ** -0.5, HKV,
                                                groups=groups)
    meta = builder.build(StepSpec((0,), (tokens,),
                                  torch.arange(num_blocks, dtype=torch.int32)[None]))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(meta.num_input_tokens, HQ, HEAD_SIZE, generator=gen).to(DTYPE)
    k, v = (torch.randn(meta.num_input_tokens, HKV, HEAD_SIZE, generator=gen).to(DTYPE)
            for _ in range(2))
    cache = torch.zeros(CPAttentionBackend.get_kv_cache_shape(num_blocks, cfg.block_size, HKV,
                                                              HEAD_SIZE), dtype=DTYPE)
    return impl, meta, q, k, v, cache, torch.empty_like(q)


def layer_task(rank: int, get_groups, tokens: int, variant: str) -> dict:
    """Pool task: one pcp=2 prefill layer forward; bytes materialized and peak extra memory
    (after a 256-token warm-up forward, so first-call costs are not counted)."""
    torch.set_num_threads(1)
    cfg = CPConfig(pcp_size=2, block_size=128)
    groups = get_groups(cfg)
    if variant == "before":
        self_part.chunk_attention = _gathering_chunk_attention
    impl, meta, q, k, v, cache, out = _layer(groups, cfg, 256, rank)
    impl.forward(None, q, k, v, cache, meta, output=out)  # warm-up
    impl, meta, q, k, v, cache, out = _layer(groups, cfg, tokens, rank)
    owned = {_storage(k), _storage(v)}  # the layer's own inputs: views of them are no copies
    prefill = self_part.pcp_prefill_attention

    def recording_prefill(ops, q_pre, k_pre, v_pre, *args):
        owned.update((_storage(k_pre), _storage(v_pre)))  # the restored step K/V
        stage("step K/V restored (all-gather)")
        return prefill(ops, q_pre, k_pre, v_pre, *args)

    copied = {"unmasked": 0, "diagonal": 0, "window": 0}
    stages = []

    def stage(name):
        stages.append({"after": name, "rss_bytes": (_status_kib("VmRSS") - rss_before) * 1024,
                       "peak_bytes": (_status_kib("VmHWM") - rss_before) * 1024})
    varlen = impl.ops.varlen_attention

    def recording_varlen(q_, k_, v_, *args, causal, window=None, **kwargs):
        kind = "window" if window is not None else ("diagonal" if causal else "unmasked")
        copied[kind] += sum(t.numel() * t.element_size() for t in (k_, v_)
                            if _storage(t) not in owned)
        result = varlen(q_, k_, v_, *args, causal=causal, window=window, **kwargs)
        stage(f"{kind} varlen_attention")
        return result

    self_part.pcp_prefill_attention = recording_prefill
    impl.ops.varlen_attention = recording_varlen
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        rss_before = _status_kib("VmRSS")
        stages.clear()
        start = time.perf_counter()
        impl.forward(None, q, k, v, cache, meta, output=out)
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM")
    finally:
        self_part.pcp_prefill_attention = prefill
    return {"rank": rank, "variant": variant, "local_rows": meta.num_local_rows,
            "kv_bytes_materialized": copied, "peak_extra_bytes": (peak - rss_before) * 1024,
            "stages": stages,
            "forward_s": seconds, "output_finite": bool(out.float().isfinite().all())}


def run(out_dir: str | Path, quick: bool = False, tokens: int = 32768) -> dict:
    tokens = 1024 if quick else tokens
    rows = []
    for variant in ("before", "after"):
        with RankPool(2, collective_timeout_s=900) as pool:  # a fresh heap per variant
            rows += pool.run(f"benchmarks.{NAME}.layer_task", tokens, variant, timeout_s=1800)
    for r in rows:
        r["kv_bytes_materialized_total"] = sum(r["kv_bytes_materialized"].values())
    by = {(r["variant"], r["rank"]): r for r in rows}
    summary = {v: {"kv_bytes_materialized_max_rank": max(by[v, i]["kv_bytes_materialized_total"]
                                                         for i in (0, 1)),
                   "peak_extra_bytes_max_rank": max(by[v, i]["peak_extra_bytes"]
                                                    for i in (0, 1))}
               for v in ("before", "after")}
    payload = {"tokens": tokens, "pcp": 2, "num_heads": HQ, "num_kv_heads": HKV,
               "head_size": HEAD_SIZE, "dtype": str(DTYPE), "rows": rows, "summary": summary}
    write_json(out_dir, NAME, payload)
    return payload


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "results"))
    parser.add_argument("--quick", action="store_true", help="1k tokens (smoke test)")
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args(argv)
    payload = run(args.out, args.quick, args.tokens)
    for r in payload["rows"]:
        mib = {k: f"{b / 2**20:.1f}" for k, b in r["kv_bytes_materialized"].items()}
        print(f"{r['variant']:>6} rank {r['rank']}: K/V copies MiB {mib}, peak extra "
              f"{r['peak_extra_bytes'] / 2**20:.1f} MiB, forward {r['forward_s']:.1f} s")
        for st in r["stages"]:
            print(f"{'':>16}after {st['after']}: resident +{st['rss_bytes'] / 2**20:.1f} MiB, "
                  f"peak so far +{st['peak_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
