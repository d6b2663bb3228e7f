"""Rank tasks for the reliability tests (importable by RankPool workers and fault harnesses).

``run_checked`` is :func:`run_workload` with three additions: the fp64 oracle on a sample of
rows (long contexts), the outputs returned (determinism), and a check that a forward writes
only the cache slots of its ``step_slot_mapping`` (the cache starts as random noise).
"""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

from pathlib import Path

import numpy as np
import torch

import cp_attention.impl.base as impl_base

from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig, CPRanks, heads_of_rank
from cp_attention.debug import assert_step_consistent, set_collective_timeout
from cp_attention.errors import StepMismatchError
from cp_attention.metadata.common import StepSpec
from cp_attention.parallel import CPGroups
from cp_attention.testing.workload import (DTYPES, Workload, allocate_blocks, make_tokens,
                                           rows_error, run_workload)


def _sample(rows: np.ndarray, limit: int | None) -> np.ndarray:
    """At most ``limit`` of ``rows``, evenly spaced, the last one included."""
    if limit is None or len(rows) <= limit:
        return rows
    pick = np.unique(np.linspace(0, len(rows) - 1, limit).round().astype(np.int64))
    return rows[pick]


def run_checked(w: Workload, rank: int = 0, groups: CPGroups | None = None,
                rows_per_req: int | None = None, keep_outputs: bool = False) -> dict:
    """Run ``w`` on one rank. Returns max_err, outputs, untouched_ok, changed_blocks, any_nan, seconds.

    rows_per_req: check only that many evenly spaced new tokens of each request and step (the
    same tokens on every rank, so CP and single-device errors cover the same rows).
    """
    cfg = w.config
    ranks = groups.ranks if groups is not None else CPRanks.of(cfg, rank)
    q_heads, kv_heads = heads_of_rank(w.num_heads, w.num_kv_heads, cfg.tp_size, ranks.tp_rank)
    q_sel, kv_sel = list(q_heads), list(kv_heads)
    tokens = make_tokens(w)
    blocks, num_blocks = allocate_blocks(w)
    backend = CPAttentionBackend
    builder = backend.get_builder_cls()(cfg, ranks, w.sliding_window, num_blocks)
    kwargs = dict(num_heads=len(q_sel), head_size=w.head_size, scale=w.scale,
                  num_kv_heads=len(kv_sel), sliding_window=w.sliding_window)
    if cfg.uses_cp:
        kwargs["groups"] = groups
    impl = backend.get_impl_cls(cfg)(**kwargs)
    dtype = DTYPES[w.dtype]
    gen = torch.Generator().manual_seed(1234 + rank)
    cache = torch.randn(backend.get_kv_cache_shape(num_blocks, cfg.block_size, len(kv_sel),
                                                   w.head_size), generator=gen).to(dtype)
    computed: dict[int, int] = defaultdict(int)
    max_blocks = max(len(b) for b in blocks.values())
    result = {"max_err": 0.0, "outputs": [], "untouched_ok": True,
              "any_nan": False, "seconds": 0.0, "changed_blocks": []}
    for step in w.steps:
        reqs = [r for r, _ in step]
        table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, :len(blocks[r])] = torch.tensor(blocks[r], dtype=torch.int32)
        spec = StepSpec(tuple(computed[r] for r in reqs), tuple(n for _, n in step), table)
        meta = builder.build(spec)
        idx = meta.local_token_idx.numpy()
        real = idx >= 0
        slot = np.searchsorted(spec.cu_new_tokens, np.where(real, idx, 0), side="right") - 1
        positions = meta.positions.numpy()
        rows = len(idx)
        q = torch.zeros(rows, len(q_sel), w.head_size, dtype=dtype)
        k = torch.zeros(rows, len(kv_sel), w.head_size, dtype=dtype)
        v = torch.zeros_like(k)
        for i, r in enumerate(reqs):
            mine = np.nonzero(real & (slot == i))[0]
            tq, tk, tv = tokens[r]
            pos = torch.from_numpy(positions[mine])
            sel = torch.from_numpy(mine)
            q[sel], k[sel], v[sel] = tq[pos][:, q_sel], tk[pos][:, kv_sel], tv[pos][:, kv_sel]
        before = cache.clone()
        start = time.perf_counter()
        out = impl.forward(None, q, k, v, cache, meta, output=torch.empty_like(q))
        result["seconds"] += time.perf_counter() - start
        _check_cache_writes(before, cache, meta.step_slot_mapping, result)
        result["any_nan"] |= bool(torch.isnan(out).any())
        if keep_outputs:
            result["outputs"].append(out.clone())
        for i, r in enumerate(reqs):
            mine = np.nonzero(real & (slot == i))[0]
            if rows_per_req is not None:  # the same token sample on every rank and config
                offsets = _sample(np.arange(spec.num_scheduled_tokens[i]), rows_per_req)
                mine = mine[np.isin(positions[mine] - spec.num_computed_tokens[i], offsets)]
            if len(mine) == 0:
                continue
            length = spec.num_computed_tokens[i] + spec.num_scheduled_tokens[i]
            result["max_err"] = max(result["max_err"], rows_error(
                w, out, mine, positions, tokens[r], length, q_sel, kv_sel))
        for r, n in step:
            computed[r] += n
    return result


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (bitwise comparison, NaN-safe)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        tensor.element_size()])


def _check_cache_writes(before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor,
                        result: dict) -> None:
    """Slots outside ``slots`` are bit-identical; record blocks that changed elsewhere."""
    flat_b = before.flatten(1, 2)  # [2, num_slots, H, D]
    flat_a = after.flatten(1, 2)
    written = torch.zeros(flat_b.shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    same = _bits(flat_b) == _bits(flat_a)
    same_slot = same.flatten(2).all(dim=-1).all(dim=0)  # [num_slots], bitwise
    bad = ~same_slot & ~written
    if bool(bad.any()):
        result["untouched_ok"] = False
        block_size = before.shape[2]
        result["changed_blocks"] += sorted({int(s) // block_size for s in torch.nonzero(bad)[:, 0]})


def run_checked_task(rank: int, get_groups, w: Workload, rows_per_req: int | None = None,
                     keep_outputs: bool = False) -> dict:
    """RankPool entry point of :func:`run_checked`."""
    groups = get_groups(w.config) if w.config.uses_cp else None
    return run_checked(w, rank, groups, rows_per_req, keep_outputs)


def step_consistency_task(rank: int, get_groups, config: CPConfig, bad_rank: int | None,
                          field: str) -> tuple[str, str, int]:
    """Every rank checks its step over the world; ``bad_rank`` alters ``field``.

    Returns (error type name or "ok", message, checksum of this rank's step).
    """
    from cp_attention.debug import step_checksum
    get_groups(config)
    computed, scheduled = [0, 7], [5, 1]
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    if rank == bad_rank:
        if field == "num_computed_tokens":
            computed[1] += 1
        elif field == "num_scheduled_tokens":
            scheduled[0] += 1
        else:
            table[1, 1] = 9
    step = StepSpec(tuple(computed), tuple(scheduled), table)
    try:
        assert_step_consistent(step)
        return "ok", "", step_checksum(step)
    except StepMismatchError as exc:
        return type(exc).__name__, str(exc), step_checksum(step)


def fault_worker(rank: int, world: int, port: int, w: Workload, fault: str, bad_rank: int,
                 timeout_s: float, set_subgroup_timeout: bool, outbox) -> None:
    """One process of a fault run: init with ``timeout_s``, then the CP forward of ``w``.

    The rendezvous store listens on ``port`` in the parent; every rank joins it as a client.

    ``fault``: "exit" (bad rank dies with os._exit before the forward), "sleep" (bad rank
    stalls), "none". Puts (rank, "ok" | exception type, message, seconds to fail) in outbox.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    groups = CPGroups.create(w.config, "cpu", timeout_s=timeout_s)
    if set_subgroup_timeout:
        set_collective_timeout(groups, timeout_s)
    import torch.distributed as dist
    dist.barrier()  # everyone is up: the fault happens mid-run, not at start-up
    if rank == bad_rank and fault == "exit":
        os._exit(3)
    if rank == bad_rank and fault == "sleep":
        time.sleep(600)
    start = time.perf_counter()
    try:
        run_checked(w, rank, groups, rows_per_req=1)
        outbox.put((rank, "ok", "", time.perf_counter() - start))
    except Exception as exc:  # the survivors' failure is the result
        outbox.put((rank, type(exc).__name__, str(exc)[:500], time.perf_counter() - start))
    outbox.close()
    outbox.join_thread()  # flush the queue's feeder thread before the hard exit
    os._exit(0)  # do not wait for a dead peer in destroy_process_group


def module_visits_task(rank: int, get_groups, w: Workload) -> list[list[str]]:
    """Run ``w`` on this rank and record, per layer forward, the ``cp_attention/impl`` modules
    its Python calls enter, in order, consecutive calls in one module counted once."""
    impl_dir = str(Path(impl_base.__file__).parent)
    visits: list[list[str]] = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(impl_dir):
            return
        module = Path(frame.f_code.co_filename).stem
        if module == "base" and frame.f_code.co_name == "forward":
            visits.append([])
        if visits and (not visits[-1] or visits[-1][-1] != module):
            visits[-1].append(module)

    groups = get_groups(w.config) if w.config.uses_cp else None
    sys.setprofile(profile)
    try:
        run_workload(w, rank, groups, check=False, device=get_groups.device)
    finally:
        sys.setprofile(None)
    return visits
