"""CPU attention ops side by side: ours (get_ops("cpu")), vLLM's CPU_ATTN kernel, SDPA.

The single-shape table (docs/performance.md section 10): paged decode (block 128, cache read in
place) and causal prefill, same data for every implementation, 1 thread by default, interleaved
repeats (min reported). Also measures the machine's memory read bandwidth (sum over a large
tensor, same thread count) and states the decode rows' achieved GB/s of K/V read, next to a
roofline: a decode does ``2 * group / element size`` flops per byte of K/V, so it streams no
faster than min(bandwidth, fp32 matmul FLOP rate / that intensity). Decode rows also time the
pcp=1 layer (``impl.forward``, cache write included; the step's metadata built once, as for all
layers of a model step, its build time reported apart) on the same decode: ``layer/op`` is the
layer's overhead over the bare op. vLLM runs where it is installed (``.venv-vllm``, plus
matplotlib); elsewhere the table has ours and SDPA only.

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.bench_cpu_ops --out results/

``--matrix`` (docs/performance.md section 12) runs the shape matrix instead
(``bench_cpu_matrix.json`` and a heatmap of ours/vLLM): decode over B x context x (Hq, Hkv) x D
x dtype, each on our cache layout ``[2, blocks, block_size, Hkv, D]`` and on vLLM's packed
``[blocks, Hkv, block_size, 2 D]``, with sequential and random block tables; causal prefill over
S x the same head shapes. Rows whose K/V copy would exceed ``--max-kv-gib`` or whose prefill
exceeds ``--max-prefill-tflop`` are listed as skipped, not dropped. Each row also gets
``bound_ms``, a time no kernel can beat on this CPU: its flops at the core's measured
multiply-add peak, or its bytes at the measured read rate of a warm buffer of their size,
whichever is longer (``cpu_limits``); ``matrix_markdown`` counts the rows where 0.8x vLLM's time
is under it. ``--matrix --quick`` is the smoke-test subset.

``--model-shapes`` (docs/performance.md section 16) runs Gemma 3's attention shapes instead
(4/1 heads of 256, sliding window 512 or none; decode and causal prefill, fp32 and bf16) as
matrix rows with every cache flushed before each timed call (``bench_cpu_model_shapes.json``).
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import cpu_limits
from benchmarks.common import cpu_model, new_figure, parse_args, save_figure, write_json
from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.common import StepSpec
from cp_attention.ops import get_ops

try:  # optional: the vLLM venv
    from vllm import _custom_ops as vllm_ops
except Exception:  # noqa: BLE001 - any import failure means "no vLLM here"
    vllm_ops = None

NAME = "bench_cpu_ops"
BLOCK_SIZE = 128


@dataclass(frozen=True)
class Case:
    label: str
    kind: str  # "decode" or "prefill"
    batch: int
    context: int  # cached tokens per request (decode) or prompt length (prefill)
    q_heads: int
    kv_heads: int
    head_size: int
    dtype: str
    window: int | None = None  # sliding window (a query sees its last ``window`` keys)


CASES = [
    Case("decode B=4, ctx 8k, 8/1, D=64, fp32", "decode", 4, 8192, 8, 1, 64, "float32"),
    Case("decode B=4, ctx 64k, 8/1, D=64, fp32", "decode", 4, 65536, 8, 1, 64, "float32"),
    Case("decode B=4, ctx 32k, 32/8, D=128, bf16", "decode", 4, 32768, 32, 8, 128, "bfloat16"),
    Case("decode B=64, ctx 4k, 8/1, D=64, fp32", "decode", 64, 4096, 8, 1, 64, "float32"),
    Case("causal prefill 8k, 8/8, D=64, fp32", "prefill", 1, 8192, 8, 8, 64, "float32"),
    Case("causal prefill 8k, 32/8, D=128, bf16", "prefill", 1, 8192, 32, 8, 128, "bfloat16"),
]
QUICK_CASES = [
    Case("decode B=2, ctx 1k, 8/1, D=64, fp32", "decode", 2, 1024, 8, 1, 64, "float32"),
    Case("decode B=2, ctx 512, 8/2, D=128, bf16", "decode", 2, 512, 8, 2, 128, "bfloat16"),
    Case("causal prefill 256, 4/2, D=64, fp32", "prefill", 1, 256, 4, 2, 64, "float32"),
]


def memory_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth: bytes of a large float32 tensor / best time of ``sum()``."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Attainable float32 FLOP rate: best ``n x n @ n x n`` matmul (same thread count)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n ** 3 / min(_timed(lambda: a @ b) for _ in range(repeats)) / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Problem:
    """One case's data: contiguous K/V per request, our paged cache, vLLM's packed cache."""

    def __init__(self, case: Case, with_vllm: bool, seed: int = 0, sequential: bool = False):
        gen = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, case.dtype)
        b, n, hkv, d = case.batch, case.context, case.kv_heads, case.head_size
        self.case, self.scale = case, 1.0 / math.sqrt(d)
        self.q_len = 1 if case.kind == "decode" else n
        self.q = torch.randn(b * self.q_len, case.q_heads, d, generator=gen).to(dtype)
        self.k = torch.randn(b * n, hkv, d, generator=gen).to(dtype)
        self.v = torch.randn(b * n, hkv, d, generator=gen).to(dtype)
        blocks_per_req = -(-n // BLOCK_SIZE)
        used_blocks = b * blocks_per_req
        # Block 0 is never handed out, as vLLM reserves its null block: every cache holds one
        # block more than the requests use. Without it, a cache of a power-of-two number of
        # blocks puts our layout's K and V halves a power of two apart (B=4 x 64k keys, 8 KV
        # heads of 64 in bf16: 2^28 bytes), and that decode ran 2.3-2.4x slower on Zen 4
        # (DRAM address aliasing; docs/performance.md section 12).
        num_blocks = used_blocks + 1
        order = (torch.arange(used_blocks) if sequential
                 else torch.randperm(used_blocks, generator=gen)) + 1
        self.block_table = order.view(b, blocks_per_req)
        self.block_table = self.block_table.to(torch.int32)
        pos = torch.arange(n)
        slots = (self.block_table.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        self.slots = slots.flatten()
        self.cu_q = torch.arange(b + 1, dtype=torch.int32) * self.q_len
        self.seq_lens = torch.full((b,), n, dtype=torch.int32)
        self.cu_k = torch.arange(b + 1, dtype=torch.int32) * n
        self.ops = get_ops("cpu")
        # Our backend's layout: [blocks, Hkv, block_size, 2 * D] viewed as two strided caches.
        self.packed = torch.empty(num_blocks, hkv, BLOCK_SIZE, 2 * d, dtype=dtype)
        kv = self.packed.unflatten(-1, (2, d)).permute(3, 0, 2, 1, 4)
        self.key_cache, self.value_cache = kv[0], kv[1]
        self.ops.reshape_and_cache(self.k, self.v, self.key_cache, self.value_cache, self.slots)
        # The project's own layout (CPAttentionBackend.get_kv_cache_shape): heads interleaved.
        self.own_cache = torch.empty(2, num_blocks, BLOCK_SIZE, hkv, d, dtype=dtype)
        # its two views made once, as for vLLM's caches (a view costs ~1 us of a 1k decode)
        self.own_key_cache, self.own_value_cache = self.own_cache.unbind(0)
        self.ops.reshape_and_cache(self.k, self.v, self.own_key_cache, self.own_value_cache,
                                   self.slots)
        self.vllm = self._vllm_cache(num_blocks, dtype) if with_vllm else None
        self.layer = self._layer(num_blocks) if case.kind == "decode" else None

    def _layer(self, num_blocks: int):
        """The pcp=1 attention layer's forward for the same decode: each request's last
        cached token is this step's new token (written to the cache again), the other
        ``context - 1`` are its cached context. The metadata is built once, as for every
        layer of a model step (its build time is reported apart)."""
        c = self.case
        cfg = CPConfig(block_size=BLOCK_SIZE)
        builder = CPAttentionBackend.get_builder_cls()(cfg, CPRanks(), c.window, num_blocks)
        impl = CPAttentionBackend.get_impl_cls(cfg)(c.q_heads, c.head_size, self.scale,
                                                    c.kv_heads, sliding_window=c.window)
        step = StepSpec((c.context - 1,) * c.batch, (1,) * c.batch, self.block_table)
        self.build_ms = min(_timed(lambda: builder.build(step)) for _ in range(5)) * 1e3
        meta = builder.build(step)
        last = torch.arange(1, c.batch + 1) * c.context - 1
        k_new, v_new = self.k[last].contiguous(), self.v[last].contiguous()
        kv_cache = self.packed.unflatten(-1, (2, c.head_size)).permute(3, 0, 2, 1, 4)
        out = torch.empty_like(self.q)
        return lambda: impl.forward(None, self.q, k_new, v_new, kv_cache, meta, output=out)

    def _vllm_cache(self, num_blocks: int, dtype: torch.dtype) -> dict:
        c = self.case
        isa = "vec" if c.head_size % 32 == 0 else "vec16"
        cache = torch.zeros(num_blocks, c.kv_heads, BLOCK_SIZE, 2 * c.head_size, dtype=dtype)
        key_cache, value_cache = cache.view(num_blocks, c.kv_heads, 2 * BLOCK_SIZE,
                                            c.head_size).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(self.k, self.v, key_cache, value_cache,
                                            self.slots, isa)
        causal = c.kind == "prefill"
        meta = vllm_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=c.batch, num_heads=c.q_heads, num_kv_heads=c.kv_heads,
            head_dim=c.head_size, seq_lens=self.seq_lens, dtype=dtype,
            query_start_loc=self.cu_q, causal=causal,
            sliding_window_size=-1 if c.window is None else c.window, isa=isa,
            enable_kv_split=True)
        return {"cache": cache, "key_cache": key_cache, "value_cache": value_cache,
                "meta": meta, "causal": causal,
                "out": torch.empty(self.q.shape, dtype=dtype)}

    # -- the implementations ---------------------------------------------------------------
    def _decode_range(self) -> dict:
        """A window's visible keys of each decode row: [n - window, n) (else all)."""
        w, n = self.case.window, self.case.context
        if w is None:
            return {}
        start = torch.full((self.case.batch,), max(0, n - w), dtype=torch.int32)
        return {"kv_start": start, "kv_end": self.seq_lens}

    def ours(self) -> torch.Tensor:
        if self.case.kind == "decode":
            return self.ops.paged_attention(self.q, self.key_cache, self.value_cache,
                                            self.block_table, self.cu_q, self.seq_lens,
                                            scale=self.scale, **self._decode_range())[0]
        return self.ops.varlen_attention(self.q, self.k, self.v, self.cu_q, self.cu_k,
                                         scale=self.scale, causal=True,
                                         window=self.case.window)[0]

    def ours_own_layout(self) -> torch.Tensor:
        """Decode on the ``[2, blocks, block_size, Hkv, D]`` cache."""
        return self.ops.paged_attention(self.q, self.own_key_cache, self.own_value_cache,
                                        self.block_table, self.cu_q, self.seq_lens,
                                        scale=self.scale, **self._decode_range())[0]

    def vllm_kernel(self) -> torch.Tensor:
        m = self.vllm
        vllm_ops.cpu_attention_with_kv_cache(
            query=self.q, key_cache=m["key_cache"], value_cache=m["value_cache"],
            output=m["out"], query_start_loc=self.cu_q, seq_lens=self.seq_lens,
            scale=self.scale, causal=m["causal"], alibi_slopes=None,
            sliding_window=-1 if self.case.window is None else self.case.window,
            block_table=self.block_table, softcap=0.0, scheduler_metadata=m["meta"],
            s_aux=None)
        return m["out"]

    def sdpa(self) -> torch.Tensor:
        """SDPA on contiguous per-request K/V (no paging, no LSE): a lower bound to beat."""
        c = self.case
        q = self.q.view(c.batch, self.q_len, c.q_heads, c.head_size).transpose(1, 2)
        k = self.k.view(c.batch, c.context, c.kv_heads, c.head_size).transpose(1, 2)
        v = self.v.view(c.batch, c.context, c.kv_heads, c.head_size).transpose(1, 2)
        mask = None
        if c.window is not None and c.kind == "decode":  # the window's keys only
            k, v = k[:, :, -c.window:], v[:, :, -c.window:]
        elif c.window is not None:  # causal band: keys (p - window, p]
            pos = torch.arange(c.context)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - c.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             is_causal=c.kind == "prefill" and mask is None,
                                             scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(self.q.shape)

    def kv_bytes(self) -> int:
        """Bytes of K and V a decode reads once (a window's keys only)."""
        visible = min(self.case.context, self.case.window or self.case.context)
        return 2 * self.k.numel() * self.k.element_size() * visible // self.case.context

    def flops_per_kv_byte(self) -> float:
        """A decode's arithmetic intensity: per cached token and KV head, QK and PV cost
        ``2 * 2 * group * D`` flops for ``2 * D * element size`` bytes."""
        group = self.case.q_heads // self.case.kv_heads
        return 2 * group * self.q_len / self.k.element_size()


def measure(case: Case, repeats: int, with_vllm: bool) -> dict:
    problem = Problem(case, with_vllm)
    impls = {"ours": problem.ours, "sdpa": problem.sdpa}
    if problem.layer is not None:
        impls["layer"] = problem.layer
    if with_vllm:
        impls["vllm"] = problem.vllm_kernel
    reference = problem.ours().float()
    errors = {name: (fn().float() - reference).abs().max().item() for name, fn in impls.items()}
    samples = {name: [] for name in impls}
    for _ in range(repeats):  # interleaved so load changes hit every implementation
        for name, fn in impls.items():
            samples[name].append(_timed(fn))
    row = {**asdict(case), "repeats": repeats,
           **{f"{name}_ms": min(s) * 1e3 for name, s in samples.items()},
           **{f"{name}_median_ms": sorted(s)[len(s) // 2] * 1e3 for name, s in samples.items()},
           "max_abs_diff_vs_ours": errors}
    if with_vllm:
        row["ours_over_vllm"] = row["ours_ms"] / row["vllm_ms"]
    row["ours_over_sdpa"] = row["ours_ms"] / row["sdpa_ms"]
    if "layer_ms" in row:
        row["layer_over_ours"] = row["layer_ms"] / row["ours_ms"]
        row["metadata_build_ms"] = problem.build_ms
    if case.kind == "decode":
        for name in impls:
            row[f"{name}_gbs"] = problem.kv_bytes() / (row[f"{name}_ms"] / 1e3) / 1e9
        row["flops_per_kv_byte"] = problem.flops_per_kv_byte()
    return row


def run(out_dir: str | Path, quick: bool = False, threads: int = 1) -> dict:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    with_vllm = vllm_ops is not None
    try:
        bandwidth = memory_bandwidth_gbs(64 if quick else 1024)
        peak_gflops = matmul_gflops(256 if quick else 1024)
        rows = [measure(c, repeats=(2 if quick else (3 if c.kind == "prefill" else 10)),
                        with_vllm=with_vllm)
                for c in (QUICK_CASES if quick else CASES)]
    finally:
        torch.set_num_threads(saved)
    for row in rows:
        if "ours_gbs" in row:
            # roofline: a decode can stream K/V no faster than memory nor than the FLOP rate
            # allows at its arithmetic intensity
            row["compute_roof_gbs"] = peak_gflops / row["flops_per_kv_byte"]
            row["roof_gbs"] = min(bandwidth, row["compute_roof_gbs"])
            row["ours_fraction_of_bandwidth"] = row["ours_gbs"] / bandwidth
            row["ours_fraction_of_roof"] = row["ours_gbs"] / row["roof_gbs"]
    payload = {
        "what": "ms per call (min over interleaved repeats); ours = get_ops('cpu') "
                "(paged_attention for decode, varlen_attention for prefill), layer = the "
                "pcp=1 layer's impl.forward (cache write included, metadata built once per "
                "step) on the same decode, vllm = "
                "vllm._custom_ops.cpu_attention_with_kv_cache, sdpa = "
                "F.scaled_dot_product_attention on contiguous K/V",
        "threads": threads, "block_size": BLOCK_SIZE, "ops": get_ops("cpu").name,
        "vllm_available": with_vllm, "memory_read_bandwidth_gbs": bandwidth,
        "matmul_gflops": peak_gflops, "rows": rows,
    }
    write_json(out_dir, NAME, payload)
    _plot(payload, out_dir)
    return payload


def _plot(payload: dict, out_dir: str | Path) -> None:
    rows = payload["rows"]
    names = [n for n in ("ours", "vllm", "sdpa") if f"{n}_ms" in rows[0]]
    fig, (ax,) = new_figure(width=11, height=4.8)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r[f"{name}_ms"] for r in rows],
               width, label=name, color=f"C{i}")
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["label"].replace(", ", "\n", 1) for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (log)")
    ax.set_title(f"CPU attention ops, {payload['threads']} thread(s), paged block "
                 f"{payload['block_size']}; memory read bandwidth "
                 f"{payload['memory_read_bandwidth_gbs']:.1f} GB/s")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, out_dir, NAME)


# -- the shape matrix (docs/performance.md section 12) ----------------------------------------
MATRIX_NAME = "bench_cpu_matrix"
GOAL_OVER_VLLM = 0.8  # the matrix's goal: ours <= 0.8x the time of vLLM's kernel on every row
HEAD_SHAPES = [(8, 1), (8, 8), (9, 3), (32, 8)]


def matrix_cases(quick: bool) -> list[tuple[Case, bool]]:
    """(case, sequential block table) of the matrix; ``quick``: a small subset."""
    if quick:
        decode = [Case(f"decode B=2 ctx 512 {hq}/{hkv} D=64 {dt}", "decode", 2, 512, hq, hkv,
                       64, dt) for hq, hkv in [(8, 1), (9, 3)] for dt in ("float32", "bfloat16")]
        prefill = [Case("prefill S=256 9/3 D=64 float32", "prefill", 1, 256, 9, 3, 64,
                        "float32")]
        return [(c, seq) for c in decode for seq in (False, True)] + [(c, False) for c in prefill]
    rows = []
    for dt in ("float32", "bfloat16"):
        for d in (64, 128):
            for hq, hkv in HEAD_SHAPES:
                for b in (1, 4, 64):
                    for ctx in (1024, 8192, 65536):
                        case = Case(f"decode B={b} ctx {ctx // 1024}k {hq}/{hkv} D={d} {dt}",
                                    "decode", b, ctx, hq, hkv, d, dt)
                        rows += [(case, False), (case, True)]
                for s in (2048, 8192, 32768):
                    rows.append((Case(f"prefill S={s // 1024}k {hq}/{hkv} D={d} {dt}", "prefill",
                                      1, s, hq, hkv, d, dt), False))
    return rows


def _skip_reason(case: Case, max_kv_gib: float, max_prefill_tflop: float) -> str | None:
    elem = 4 if case.dtype == "float32" else 2
    kv_gib = 2 * case.batch * case.context * case.kv_heads * case.head_size * elem / 2 ** 30
    if kv_gib > max_kv_gib:
        return f"K/V {kv_gib:.1f} GiB per copy > --max-kv-gib {max_kv_gib}"
    if case.kind == "prefill":
        tflop = 4 * case.q_heads * case.head_size * case.context ** 2 / 2 / 1e12
        if tflop > max_prefill_tflop:
            return f"{tflop:.2f} TFLOP > --max-prefill-tflop {max_prefill_tflop}"
    return None


MAX_DECODE_REPEATS = 200


def measure_matrix_row(case: Case, sequential: bool, repeats: int, with_vllm: bool,
                       roof: tuple[float, float], peaks: dict[str, float],
                       flush: torch.Tensor | None = None) -> dict:
    """One matrix row: vLLM's kernel, ours (decode: on both cache layouts), SDPA; min of
    interleaved repeats (decode: at least ``repeats``, more for short calls, up to
    MAX_DECODE_REPEATS, so a 50 µs call is not judged on 3 cold samples); ours as a fraction
    of its roofline; the row's lower bound on this CPU (:func:`bound_ms`). ``flush``: a buffer
    larger than the last-level cache, read before every timed call (caches flushed, as for a
    layer's K/V in a model step)."""
    problem = Problem(case, with_vllm, sequential=sequential)
    impls = {"ours": problem.ours, "sdpa": problem.sdpa}
    if case.kind == "decode":
        impls["ours_own_layout"] = problem.ours_own_layout
    if with_vllm:
        impls["vllm"] = problem.vllm_kernel
    reference = problem.ours().float()
    diff = max((fn().float() - reference).abs().max().item() for fn in impls.values())
    if case.kind == "decode":  # short calls: enough repeats for ~50 ms per implementation
        repeats = min(MAX_DECODE_REPEATS, max(repeats, int(0.05 / _timed(problem.ours))))
    samples = {name: [] for name in impls}
    for rep in range(repeats):
        for name, fn in impls.items():
            if name != "sdpa" or case.kind == "prefill" or rep == 0:  # decode SDPA: one call
                if flush is not None:
                    flush.sum()
                samples[name].append(_timed(fn))
    row = {**asdict(case), "sequential_blocks": sequential, "repeats": repeats,
           "caches_flushed": flush is not None,
           **{f"{name}_ms": min(s) * 1e3 for name, s in samples.items()},
           "max_abs_diff": diff}
    bandwidth, gflops = roof
    if case.kind == "decode":
        row["ours_packed_ms"] = row.pop("ours_ms")
        row["ours_ms"] = max(row["ours_packed_ms"], row["ours_own_layout_ms"])  # the worse
        roof_gbs = min(bandwidth, gflops / problem.flops_per_kv_byte())
        row["ours_fraction_of_roof"] = problem.kv_bytes() / (row["ours_ms"] / 1e3) / 1e9 / roof_gbs
    else:
        row["ours_fraction_of_roof"] = row_flops(row) / (row["ours_ms"] / 1e3) / 1e9 / gflops
    if with_vllm:
        row["ours_over_vllm"] = row["ours_ms"] / row["vllm_ms"]
    row["ours_over_sdpa"] = row["ours_ms"] / row["sdpa_ms"]
    row["read_gbs"] = _read_gbs(row_bytes(row))
    row["bound_ms"] = bound_ms(row, peaks)
    return row


def _logged_row(case: Case, sequential: bool, repeats: int, with_vllm: bool,
                roof: tuple[float, float], peaks: dict[str, float],
                flush: torch.Tensor | None = None) -> dict:
    """:func:`measure_matrix_row`, its caches freed and its times printed."""
    row = measure_matrix_row(case, sequential, repeats, with_vllm, roof, peaks, flush)
    gc.collect()  # the row's caches sit in reference cycles (layer, bound methods)
    print(f"{case.label}{' seq' if sequential else ''}: " + ", ".join(
        f"{k[:-3]} {row[k]:.2f}" for k in row if k.endswith("_ms")), flush=True)
    return row


@lru_cache(maxsize=None)
def _read_gbs(nbytes: int) -> float:
    return cpu_limits.read_gbs(nbytes)


def run_matrix(out_dir: str | Path, quick: bool = False, threads: int = 1,
               max_kv_gib: float = 1.0, max_prefill_tflop: float = 0.3,
               time_budget_s: float | None = None) -> dict:
    """The shape matrix; writes ``bench_cpu_matrix.json`` and its heatmap. Rows run from the
    smallest problem to the largest; past ``time_budget_s`` the rest are listed as skipped."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    with_vllm = vllm_ops is not None
    rows, skipped = [], []
    start = time.perf_counter()
    cases = sorted(matrix_cases(quick), key=lambda cs: (
        cs[0].kind != "decode", cs[0].batch * cs[0].context * cs[0].kv_heads * cs[0].head_size
        * (4 if cs[0].dtype == "float32" else 2) * (cs[0].q_heads if cs[0].kind == "prefill" else 1)))
    try:
        roof = (memory_bandwidth_gbs(64 if quick else 1024), matmul_gflops(256 if quick else 1024))
        peaks = cpu_limits.peak_gflops()
        for case, sequential in cases:
            reason = _skip_reason(case, max_kv_gib, max_prefill_tflop)
            if reason is None and time_budget_s is not None and \
                    time.perf_counter() - start > time_budget_s:
                reason = f"past the run's time budget of {time_budget_s:.0f} s"
            if reason is not None:
                skipped.append({"label": case.label, "sequential_blocks": sequential,
                                "reason": reason})
                continue
            repeats = 2 if quick else (3 if case.kind == "decode" else 2)
            rows.append(_logged_row(case, sequential, repeats, with_vllm, roof, peaks))
    finally:
        torch.set_num_threads(saved)
    payload = {
        "what": "ms per call, min over interleaved repeats; decode ours = the worse of our "
                "kernel on vLLM's packed layout (ours_packed) and on our own [2, blocks, "
                "block_size, Hkv, D] layout (ours_own_layout); prefill ours = varlen_attention "
                "(causal); vllm = cpu_attention_with_kv_cache (its packed layout, no LSE); sdpa "
                "on contiguous K/V (decode: one timed call, it is 10-30x slower); "
                "ours_fraction_of_roof: decode K/V GB/s over min(bandwidth, GFLOP/s / flops "
                "per byte), prefill GFLOP/s over the fp32 matmul rate; bound_ms: no kernel "
                "can take less on this CPU (the row's flops at peak_gflops of its dtype, its "
                "bytes at read_gbs, the measured read rate of a warm buffer of their size)",
        "cpu": cpu_model(), "threads": threads, "block_size": BLOCK_SIZE,
        "ops": get_ops("cpu").name, "vllm_available": with_vllm,
        "memory_read_bandwidth_gbs": roof[0], "matmul_gflops": roof[1], "peak_gflops": peaks,
        "max_kv_gib": max_kv_gib, "max_prefill_tflop": max_prefill_tflop,
        "run_s": time.perf_counter() - start, "rows": rows, "skipped": skipped,
    }
    write_json(out_dir, MATRIX_NAME, payload)
    _plot_matrix(payload, out_dir)
    return payload


def _plot_matrix(payload: dict, out_dir: str | Path) -> None:
    """Heatmap of ours/vLLM (ours/SDPA without vLLM): decode (random blocks) and prefill."""
    key = "ours_over_vllm" if payload["vllm_available"] else "ours_over_sdpa"
    panels = [("decode", [r for r in payload["rows"]
                          if r["kind"] == "decode" and not r["sequential_blocks"]]),
              ("prefill", [r for r in payload["rows"] if r["kind"] == "prefill"])]
    fig, axes = new_figure(ncols=2, width=7, height=7)
    for ax, (kind, rows) in zip(axes, panels):
        ys = sorted({(r["q_heads"], r["kv_heads"], r["head_size"], r["dtype"]) for r in rows})
        xs = sorted({(r["batch"], r["context"]) for r in rows})
        grid = [[float("nan")] * len(xs) for _ in ys]
        for r in rows:
            y = ys.index((r["q_heads"], r["kv_heads"], r["head_size"], r["dtype"]))
            grid[y][xs.index((r["batch"], r["context"]))] = r[key]
        image = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.3, vmax=1.7, aspect="auto")
        for y, line in enumerate(grid):
            for x, value in enumerate(line):
                if value == value:
                    ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([f"B={b}\n{c // 1024}k" if kind == "decode" else f"S={c // 1024}k"
                            for b, c in xs], fontsize=6)
        ax.set_yticks(range(len(ys)))
        ax.set_yticklabels([f"{hq}/{hkv} D={d} {dt[:4]}" for hq, hkv, d, dt in ys], fontsize=6)
        ax.set_title(f"{kind}: {key.replace('_', ' ')} (< 1: ours faster)", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.7)
    fig.suptitle(f"{payload['cpu']}, {payload['threads']} thread; blank: skipped (JSON)",
                 fontsize=9)
    save_figure(fig, out_dir, MATRIX_NAME)


def row_flops(row: dict) -> float:
    """The arithmetic of a matrix row: QK and PV, 2 flops per multiply-add (decode: one query
    token per request over its context; prefill: the causal lower triangle)."""
    per_key = 4.0 * row["batch"] * row["q_heads"] * row["head_size"]
    n, w = row["context"], row.get("window") or row["context"]
    if row["kind"] == "decode":
        return per_key * min(n, w)
    full = min(n, w)  # queries 0..w-1 see p + 1 keys, the rest w
    return per_key * (full * (full + 1) / 2 + (n - full) * w)


def row_bytes(row: dict) -> int:
    """The bytes a matrix row must read at least once: decode the K/V of its context; prefill
    its Q, K, V and output."""
    elem = 4 if row["dtype"] == "float32" else 2
    per_token = (2 * row["kv_heads"] if row["kind"] == "decode"
                 else 2 * (row["q_heads"] + row["kv_heads"])) * row["head_size"]
    tokens = row["context"]
    if row["kind"] == "decode" and row.get("window"):
        tokens = min(tokens, row["window"])
    return row["batch"] * tokens * per_token * elem


def bound_ms(row: dict, peaks: dict[str, float]) -> float:
    """A lower bound on the row's time on this CPU: the larger of its flops at the measured
    multiply-add peak of its dtype (bf16: vdpbf16ps, where the CPU has it, for all of them) and
    its bytes at ``row["read_gbs"]``, the measured read rate of a warm buffer of that size.
    Optimistic on purpose (no softmax, no overlap cost, no call overhead): a kernel that needs
    less time than this cannot exist here."""
    return 1e3 * max(row_flops(row) / (peaks[row["dtype"]] * 1e9),
                     row_bytes(row) / (row["read_gbs"] * 1e9))


def goal_share_of_bound(row: dict, goal: float = GOAL_OVER_VLLM) -> float:
    """bound / (``goal`` x vLLM's time): the share of this CPU's ceiling a kernel must reach to
    take ``goal`` x vLLM's time on the row; above 1 the goal is out of reach here."""
    return row["bound_ms"] / (goal * row["vllm_ms"])


def matrix_markdown(payload: dict) -> str:
    """docs/performance.md tables of a matrix run: decode ours/vLLM per (heads, D, dtype) x
    (B, context) as "random / sequential blocks", prefill ours/vLLM and ours/SDPA per S, then
    the worst row of each goal."""
    key = "ours_over_vllm" if payload["vllm_available"] else "ours_over_sdpa"
    rows = payload["rows"]

    def shape(r: dict) -> tuple:
        return r["q_heads"], r["kv_heads"], r["head_size"], r["dtype"]

    def size(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 else str(n)

    lines = []
    decode = [r for r in rows if r["kind"] == "decode"]
    cols = sorted({(r["batch"], r["context"]) for r in decode})
    lines.append("| decode " + key.replace("_", " ") + " | " + " | ".join(
        f"B={b} {size(c)}" for b, c in cols) + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for sh in sorted({shape(r) for r in decode}):
        cells = []
        for b, c in cols:
            got = {r["sequential_blocks"]: r[key] for r in decode
                   if shape(r) == sh and (r["batch"], r["context"]) == (b, c)}
            cells.append(" / ".join(f"{got[s]:.2f}" for s in (False, True) if s in got) or "skip")
        lines.append(f"| {sh[0]}/{sh[1]} D={sh[2]} {sh[3]} | " + " | ".join(cells) + " |")
    prefill = [r for r in rows if r["kind"] == "prefill"]
    sizes = sorted({r["context"] for r in prefill})
    lines += ["", "| prefill: ours/vLLM, ours/SDPA | " + " | ".join(
        f"S={size(n)}" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for sh in sorted({shape(r) for r in prefill}):
        cells = []
        for size in sizes:
            got = [r for r in prefill if shape(r) == sh and r["context"] == size]
            cells.append(f"{got[0].get('ours_over_vllm', float('nan')):.2f}, "
                         f"{got[0]['ours_over_sdpa']:.2f}" if got else "skip")
        lines.append(f"| {sh[0]}/{sh[1]} D={sh[2]} {sh[3]} | " + " | ".join(cells) + " |")

    def worst(items: list[dict], field: str, high: bool = True) -> str:
        if not items:
            return "none"
        r = (max if high else min)(items, key=lambda x: x[field])
        return (f"{r[field]:.2f} ({r['kind']} B={r['batch']} {r['context']} {r['q_heads']}/"
                f"{r['kv_heads']} D={r['head_size']} {r['dtype']}"
                f"{' seq' if r.get('sequential_blocks') else ''})")

    lines += ["", f"Worst rows: {key.replace('_', ' ')} {worst(rows, key)}; prefill ours/SDPA "
              f"{worst(prefill, 'ours_over_sdpa')}; decode fraction of roof "
              f"{worst(decode, 'ours_fraction_of_roof', high=False)}. "
              f"{len(payload['skipped'])} rows skipped (sizes in the JSON)."]
    if payload["vllm_available"]:
        missed = [r for r in rows if r["ours_over_vllm"] > GOAL_OVER_VLLM]
        share = [goal_share_of_bound(r) for r in missed]
        below = [r for r in rows if min(r[k] for k in r if k.endswith("_ms") and
                                        k != "bound_ms") < r["bound_ms"]]
        peaks = payload["peak_gflops"]
        lines.append(
            f"Rows above {GOAL_OVER_VLLM}x vLLM: {len(missed)}; on {sum(f > 1 for f in share)} "
            f"of them {GOAL_OVER_VLLM}x vLLM's time is under the row's bound on this CPU (out "
            f"of reach for any kernel), {sum(f > 0.85 for f in share)} need more than 85 % of "
            f"the bound's rate, {sum(f > 0.7 for f in share)} more than 70 % (bound: flops at "
            f"the multiply-add peak, " + ", ".join(f"{d} {g:.1f}" for d, g in sorted(
                peaks.items())) + " GFLOP/s, or bytes at the read rate for their size; "
            f"{len(below)} measured times under it).")
    return "\n".join(lines)


# -- long-context model shapes (issue 36): head size 256, 4/1 heads, window 512 or none -------
MODEL_SHAPES_NAME = "bench_cpu_model_shapes"
FLUSH_MIB = 256  # read before every timed call: more than any last-level cache here


def model_shape_cases(quick: bool) -> list[Case]:
    """Gemma 3 270M's attention (4 query / 1 KV head of 256; window 512 on 15 of 18 layers):
    decode and causal prefill, fp32 and bf16, with and without the window."""
    if quick:
        return [Case(f"{kind} B=1 ctx 1k 4/1 D=256 w={w} float32", kind, 1, 1024, 4, 1, 256,
                     "float32", w) for kind in ("decode", "prefill") for w in (None, 512)]
    cases = []
    for dt in ("float32", "bfloat16"):
        for w in (None, 512):
            for b, ctx in ((1, 8192), (4, 8192), (1, 32768), (4, 32768)):
                cases.append(Case(f"decode B={b} ctx {ctx // 1024}k 4/1 D=256 w={w} {dt}",
                                  "decode", b, ctx, 4, 1, 256, dt, w))
            for n in (2048, 8192):
                cases.append(Case(f"prefill S={n // 1024}k 4/1 D=256 w={w} {dt}", "prefill",
                                  1, n, 4, 1, 256, dt, w))
    return cases


def run_model_shapes(out_dir: str | Path, quick: bool = False, threads: int = 1) -> dict:
    """:func:`model_shape_cases` measured as matrix rows (random block order) with caches
    flushed; writes ``bench_cpu_model_shapes.json`` and a bar chart of ours/vLLM."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    with_vllm = vllm_ops is not None
    start, rows = time.perf_counter(), []
    flush = torch.ones((4 if quick else FLUSH_MIB) << 18)
    try:
        roof = (memory_bandwidth_gbs(64 if quick else 1024), matmul_gflops(256 if quick else 1024))
        peaks = cpu_limits.peak_gflops()
        for case in model_shape_cases(quick):
            repeats = 2 if quick else (5 if case.kind == "decode" else 2)
            rows.append(_logged_row(case, False, repeats, with_vllm, roof, peaks, flush))
    finally:
        torch.set_num_threads(saved)
    payload = {
        "what": "as bench_cpu_matrix (ms per call, min over interleaved repeats; decode ours = "
                "the worse of our two cache layouts), with every cache flushed before each "
                f"timed call (a {FLUSH_MIB} MiB read); window w: a query sees its last w keys "
                "(decode: ours by kv_start/kv_end, vLLM by sliding_window=w, SDPA on the "
                "window's keys; prefill: ours varlen window=w, SDPA a band mask)",
        "cpu": cpu_model(), "threads": threads, "block_size": BLOCK_SIZE,
        "ops": get_ops("cpu").name, "vllm_available": with_vllm,
        "memory_read_bandwidth_gbs": roof[0], "matmul_gflops": roof[1], "peak_gflops": peaks,
        "run_s": time.perf_counter() - start, "rows": rows,
    }
    write_json(out_dir, MODEL_SHAPES_NAME, payload)
    _plot_model_shapes(payload, out_dir)
    return payload


def _plot_model_shapes(payload: dict, out_dir: str | Path) -> None:
    rows = payload["rows"]
    key = "ours_over_vllm" if payload["vllm_available"] else "ours_over_sdpa"
    fig, (ax,) = new_figure(width=11, height=4.8)
    ax.bar(range(len(rows)), [r[key] for r in rows],
           color=["C0" if r.get(key, 0) <= 1.0 else "C3" for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["label"].replace(" 4/1 D=256", "") for r in rows], rotation=70,
                       fontsize=6, ha="right")
    ax.set_ylabel(key.replace("_", " "))
    ax.set_title(f"Gemma 3 attention shapes (4/1 heads of 256), caches flushed, "
                 f"{payload['threads']} thread; {payload['cpu']}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, out_dir, MODEL_SHAPES_NAME)


def model_shapes_markdown(payload: dict) -> str:
    """The table of :func:`run_model_shapes`: times, ratios, and how many rows meet 1.0x."""
    lines = ["| row | ours ms | vLLM ms | SDPA ms | ours / vLLM | bound ms | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['label']} | {r['ours_ms']:.3f} | {r.get('vllm_ms', float('nan')):.3f} "
                     f"| {r['sdpa_ms']:.3f} | {r.get('ours_over_vllm', float('nan')):.2f} | "
                     f"{r['bound_ms']:.3f} | {r['max_abs_diff']:.1e} |")
    met = [r for r in payload["rows"] if r.get("ours_over_vllm", 9) <= 1.0]
    lines.append(f"\n{len(met)} of {len(payload['rows'])} rows at or under 1.0x vLLM's time "
                 f"({payload['cpu']}, {payload['threads']} thread, caches flushed).")
    return "\n".join(lines)


def _matrix_args(parser) -> None:
    parser.add_argument("--matrix", action="store_true",
                        help="the shape matrix (docs/performance.md section 12)")
    parser.add_argument("--max-kv-gib", type=float, default=1.0,
                        help="matrix: skip rows whose K/V copy exceeds this")
    parser.add_argument("--max-prefill-tflop", type=float, default=0.3,
                        help="matrix: skip prefill rows above this many TFLOP")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="matrix: list the rows left after this many seconds as skipped")
    parser.add_argument("--model-shapes", action="store_true",
                        help="Gemma 3's attention shapes, caches flushed (issue 36)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, _matrix_args)
    if args.model_shapes and args.matrix:
        raise SystemExit("--model-shapes and --matrix are two runs: pick one")
    if args.model_shapes:
        payload = run_model_shapes(args.out, args.quick)
        print(model_shapes_markdown(payload))
        return
    if args.matrix:
        payload = run_matrix(args.out, args.quick, max_kv_gib=args.max_kv_gib,
                             max_prefill_tflop=args.max_prefill_tflop,
                             time_budget_s=args.time_budget_s)
        print(f"{payload['cpu']}: {len(payload['rows'])} rows in {payload['run_s']:.0f} s, "
              f"{len(payload['skipped'])} skipped")
        print(matrix_markdown(payload))
        return
    payload = run(args.out, args.quick)
    print(f"memory read bandwidth: {payload['memory_read_bandwidth_gbs']:.1f} GB/s, fp32 matmul "
          f"{payload['matmul_gflops']:.1f} GFLOP/s ({payload['threads']} thread)")
    for r in payload["rows"]:
        parts = [f"{n} {r[f'{n}_ms']:.2f} ms" for n in ("ours", "vllm", "sdpa") if f"{n}_ms" in r]
        ratio = f" ours/vllm {r['ours_over_vllm']:.2f}" if "ours_over_vllm" in r else ""
        gbs = (f" ({r['ours_gbs']:.1f} GB/s, {100 * r['ours_fraction_of_bandwidth']:.0f}% of "
               f"bandwidth, {100 * r['ours_fraction_of_roof']:.0f}% of roof "
               f"{r['roof_gbs']:.1f} GB/s)") if "ours_gbs" in r else ""
        if "layer_over_ours" in r:
            gbs += f", layer/op {r['layer_over_ours']:.3f}"
        print(f"{r['label']}: " + ", ".join(parts) + ratio + gbs)


if __name__ == "__main__":
    main()
