"""Multi-step attention workloads run on one rank and checked against the fp64 oracle.

A :class:`Workload` is a list of steps; each step schedules new tokens of some requests (a
request's first step is its prompt, or a first chunk of it). Token data is generated on the CPU
from the seed, identically on every rank; each rank feeds its local rows and heads on its
device (the layer's inputs, output and persistent KV cache live there; metadata stays on the
CPU as the builder makes it, and the impl moves what its ops index with), and compares its
outputs, copied back to the CPU, with :func:`dense_attention` in float64.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig, CPRanks, heads_of_rank
from cp_attention.metadata.common import StepSpec
from cp_attention.metadata.kv_layout import KVSharding
from cp_attention.ops import AttentionOps, get_ops
from cp_attention.parallel import CPGroups
from cp_attention.testing.dense import dense_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
# Largest |layer output - float64 oracle| the launchers accept, per activation dtype.
ORACLE_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


@dataclass(frozen=True)
class Workload:
    """A deterministic multi-step workload. steps: each a tuple of (request id, new tokens)."""

    config: CPConfig
    steps: tuple[tuple[tuple[int, int], ...], ...]
    num_heads: int = 4
    num_kv_heads: int = 4
    head_size: int = 32
    dtype: str = "float32"
    sliding_window: int | None = None
    encoder_only: bool = False
    logit_scale: float = 1.0  # > 1 makes the softmax peaked
    seed: int = 0
    spare_blocks: int = 2
    dcp_comm_backend: str = "ag_rs"  # how the CP impl combines DCP partials ("ag_rs" | "a2a")

    @property
    def final_lengths(self) -> dict[int, int]:
        lengths: dict[int, int] = defaultdict(int)
        for step in self.steps:
            for req, new in step:
                lengths[req] += new
        return dict(lengths)

    @property
    def scale(self) -> float:
        return self.logit_scale / self.head_size ** 0.5


def make_tokens(w: Workload) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per request: q [L, Hq, D], k/v [L, Hkv, D] in the workload dtype (same on every rank)."""
    tokens = {}
    dtype = DTYPES[w.dtype]
    for req, length in sorted(w.final_lengths.items()):
        gen = torch.Generator().manual_seed(w.seed * 100_003 + req)
        q = torch.randn(length, w.num_heads, w.head_size, generator=gen)
        k = torch.randn(length, w.num_kv_heads, w.head_size, generator=gen)
        v = torch.randn(length, w.num_kv_heads, w.head_size, generator=gen)
        tokens[req] = (q.to(dtype), k.to(dtype), v.to(dtype))
    return tokens


def allocate_blocks(w: Workload) -> tuple[dict[int, list[int]], int]:
    """Shuffled distinct virtual blocks per request; returns (blocks per request, num_blocks)."""
    cfg = w.config
    lengths = w.final_lengths
    needed = {r: int(KVSharding.of(cfg).blocks_needed(np.array([n]))[0])
              for r, n in lengths.items()}
    num_blocks = sum(needed.values()) + w.spare_blocks
    perm = np.random.default_rng(w.seed).permutation(num_blocks).tolist()
    blocks, start = {}, 0
    for r in sorted(needed):
        blocks[r] = perm[start:start + needed[r]]
        start += needed[r]
    return blocks, num_blocks


@dataclass
class RankReport:
    """What one rank measured over a workload."""

    rank: int
    max_err: float = 0.0
    max_err_per_step: list[float] = field(default_factory=list)
    rows_per_step: list[int] = field(default_factory=list)
    tokens_per_step: list[list[int]] = field(default_factory=list)  # global token idx computed
    any_nan: bool = False
    cache_exact: bool = True
    cache_bytes: int = 0
    comm_bytes: int = 0
    comm_bytes_per_step: list[int] = field(default_factory=list)
    comm_calls: dict[str, int] = field(default_factory=dict)  # collective name -> calls
    seconds: float = 0.0
    seconds_per_step: list[float] = field(default_factory=list)  # forward, device synchronized
    device: str = "cpu"  # where the layer's tensors lived
    ops: str = ""  # class name of the attention ops that ran
    backend: str | None = None  # collective backend of the default group (None: no group)


def run_workload(w: Workload, rank: int = 0, groups: CPGroups | None = None,
                 check: bool = True, device: torch.device | str | None = None,
                 ops: AttentionOps | None = None,
                 on_step: Callable[[int], None] | None = None) -> RankReport:
    """Run every step on ``rank``; compare each real output row with the fp64 oracle.

    device: where the layer runs (default ``groups.device``, else the CPU); ops: the attention
    ops (default ``get_ops(device)``); on_step: called with the step index after each step.
    """
    cfg = w.config
    cfg.validate_heads(w.num_heads, w.num_kv_heads)
    if device is None:
        device = groups.device if groups is not None else "cpu"
    device = torch.device(device)
    ops = ops if ops is not None else get_ops(device)
    device_module = torch.get_device_module(device)
    ranks = groups.ranks if groups is not None else CPRanks.of(cfg, rank)
    q_heads, kv_heads = heads_of_rank(w.num_heads, w.num_kv_heads, cfg.tp_size, ranks.tp_rank)
    tokens = make_tokens(w)
    blocks, num_blocks = allocate_blocks(w)
    backend = CPAttentionBackend
    builder = backend.get_builder_cls()(cfg, ranks, w.sliding_window, num_blocks)
    attn_type = "encoder_only" if w.encoder_only else "decoder"
    impl_kwargs = dict(num_heads=len(q_heads), head_size=w.head_size, scale=w.scale,
                       num_kv_heads=len(kv_heads), sliding_window=w.sliding_window,
                       attn_type=attn_type, ops=ops)
    if cfg.uses_cp:
        impl = backend.get_impl_cls(cfg)(**impl_kwargs, groups=groups,
                                         dcp_comm_backend=w.dcp_comm_backend)
    else:
        impl = backend.get_impl_cls(cfg)(**impl_kwargs)
    dtype = DTYPES[w.dtype]
    cache = None
    if not w.encoder_only:
        cache = torch.zeros(backend.get_kv_cache_shape(num_blocks, cfg.block_size, len(kv_heads),
                                                       w.head_size), dtype=dtype, device=device)
    report = RankReport(rank=rank, device=str(device), ops=type(ops).__name__,
                        backend=dist.get_backend() if dist.is_initialized() else None)
    computed: dict[int, int] = defaultdict(int)
    max_blocks = max(len(b) for b in blocks.values())
    q_sel, kv_sel = list(q_heads), list(kv_heads)
    for step_idx, step in enumerate(w.steps):
        reqs = [r for r, _ in step]
        table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, :len(blocks[r])] = torch.tensor(blocks[r], dtype=torch.int32)
        spec = StepSpec(tuple(0 if w.encoder_only else computed[r] for r in reqs),
                        tuple(n for _, n in step), table)
        meta = builder.build(spec)
        idx = meta.local_token_idx.numpy()
        cu = spec.cu_new_tokens
        real = idx >= 0
        slot = np.searchsorted(cu, np.where(real, idx, 0), side="right") - 1
        rows = len(idx)
        q = torch.zeros(rows, len(q_sel), w.head_size, dtype=dtype)
        k = torch.zeros(rows, len(kv_sel), w.head_size, dtype=dtype)
        v = torch.zeros_like(k)
        positions = meta.positions.numpy()
        for i, r in enumerate(reqs):  # each request's rows at once
            mine = torch.from_numpy(np.nonzero(real & (slot == i))[0])
            pos = torch.from_numpy(positions[mine.numpy()])
            tq, tk, tv = tokens[r]
            q[mine], k[mine], v[mine] = tq[pos][:, q_sel], tk[pos][:, kv_sel], tv[pos][:, kv_sel]
        q, k, v = q.to(device), k.to(device), v.to(device)
        before = impl.comm.total_bytes  # every impl counts its bytes (0 on one device)
        device_module.synchronize()
        start = time.perf_counter()
        out = impl.forward(None, q, k, v, cache, meta, output=torch.empty_like(q))
        device_module.synchronize()
        report.seconds_per_step.append(time.perf_counter() - start)
        report.seconds += report.seconds_per_step[-1]
        out = out.cpu()
        report.comm_bytes_per_step.append(impl.comm.total_bytes - before)
        report.any_nan |= bool(torch.isnan(out).any())
        report.rows_per_step.append(rows)
        report.tokens_per_step.append(sorted(idx[real].tolist()))
        step_err = 0.0
        if check:
            for i, r in enumerate(reqs):
                mine = np.nonzero(real & (slot == i))[0]
                if len(mine) == 0:
                    continue
                length = spec.num_computed_tokens[i] + spec.num_scheduled_tokens[i]
                step_err = max(step_err, rows_error(w, out, mine, positions, tokens[r], length,
                                                    q_sel, kv_sel))
            pad_rows = torch.from_numpy(~real)
            if bool((out[pad_rows] != 0).any()):
                step_err = float("inf")  # pad rows must come back zero
        report.max_err_per_step.append(step_err)
        report.max_err = max(report.max_err, step_err)
        for r, n in step:
            computed[r] += n
        if on_step is not None:
            on_step(step_idx)
    if cache is not None:
        report.cache_bytes = cache.numel() * cache.element_size()
        if check:
            report.cache_exact = _cache_matches(w, cache.cpu(), tokens, blocks, computed, ranks,
                                                kv_sel)
    report.comm_bytes, report.comm_calls = impl.comm.total_bytes, dict(impl.comm.calls)
    return report


def rows_error(w: Workload, out: torch.Tensor, rows: np.ndarray, positions: np.ndarray,
               request_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor], length: int,
               q_sel: list[int], kv_sel: list[int]) -> float:
    """Max |out - fp64 oracle| over ``rows`` (one request's rows at ``positions[rows]``)."""
    tq, tk, tv = request_tokens
    pos = torch.from_numpy(positions[rows])
    ref, _ = dense_attention(tq[pos][:, q_sel], tk[:length, kv_sel], tv[:length, kv_sel], pos,
                             w.scale, causal=not w.encoder_only, window=w.sliding_window)
    return (out[torch.from_numpy(rows)].double() - ref).abs().max().item()


def _cache_matches(w, cache, tokens, blocks, computed, ranks, kv_sel) -> bool:
    """The cache holds exactly this shard's tokens at their slots, zeros everywhere else.

    A window layer with ``window_cache="window"`` may leave a token's slot unwritten (zeros)
    unless it is among its request's last ``window - 1``; no slot holds anything else."""
    cfg = w.config
    shard = cfg.kv_rank(ranks.pcp_rank, ranks.dcp_rank)
    expected = torch.zeros_like(cache)
    required = torch.ones(cache.shape[1:3], dtype=torch.bool)  # [blocks, block_size]
    partial = w.sliding_window is not None and cfg.window_cache == "window"
    for r, length in computed.items():
        pos = np.arange(length)
        mine = pos[KVSharding.of(cfg).owner(pos) == shard]
        local = KVSharding.of(cfg).local_position(mine)
        table = np.asarray(blocks[r])
        block_ids = torch.from_numpy(table[local // cfg.block_size])
        offsets = torch.from_numpy(local % cfg.block_size)
        _, tk, tv = tokens[r]
        expected[0, block_ids, offsets] = tk[torch.from_numpy(mine)][:, kv_sel]
        expected[1, block_ids, offsets] = tv[torch.from_numpy(mine)][:, kv_sel]
        if partial:
            required[block_ids, offsets] = torch.from_numpy(mine >= length - (w.sliding_window - 1))
    if not partial:
        return bool(torch.equal(expected, cache))
    same = (cache == expected).flatten(3).all(-1).all(0)  # [blocks, block_size] per slot
    unwritten = (cache == 0).flatten(3).all(-1).all(0)
    return bool((same | (unwritten & ~required)).all())


def run_workload_task(rank: int, get_groups, w: Workload, check: bool = True) -> RankReport:
    """Entry point for :class:`~cp_attention.testing.pool.RankPool` workers (on the pool's
    device)."""
    groups = get_groups(w.config) if w.config.uses_cp else None
    return run_workload(w, rank, groups, check, device=get_groups.device)
