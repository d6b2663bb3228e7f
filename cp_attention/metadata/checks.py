"""Checks of a step, of rank coordinates and of the planned metadata (pure, no process groups).

* :func:`validate_ranks`: coordinates consistent with the config (the builders call it once);
* :func:`validate_step`: a step's block table against the cache (O(requests x blocks); the
  builder calls it once per step);
* :func:`validate_rank_plans`: the invariants (docs/pcp.md, docs/dcp.md) of a step's plan over
  every (pcp_rank, dcp_rank): ownership, restore permutations, lengths, index ranges (the planner
  fuzzers and debug runs call it).
Every check raises :class:`~cp_attention.errors.StepError` naming the field and the value.
"""
from __future__ import annotations

import numpy as np

from cp_attention.config import CPConfig, CPRanks, is_int
from cp_attention.errors import StepError
from cp_attention.mathutils import ceil_div
from cp_attention.metadata.common import StepSpec, decode_mask, ranges_concat
from cp_attention.metadata.kv_layout import KVSharding

__all__ = ["validate_rank_plans", "validate_ranks", "validate_step"]


def validate_ranks(config: CPConfig, ranks: CPRanks) -> None:
    """Coordinates consistent with the config (dcp_rank == tp_rank % dcp_size, all in range)."""
    for name, value, size in (("pcp_rank", ranks.pcp_rank, config.pcp_size),
                              ("tp_rank", ranks.tp_rank, config.tp_size),
                              ("dcp_rank", ranks.dcp_rank, config.dcp_size)):
        if not is_int(value) or not 0 <= value < size:
            raise StepError(f"{name} ({value!r}) must be an integer in [0, {size})")
    if ranks.dcp_rank != ranks.tp_rank % config.dcp_size:
        raise StepError(f"dcp_rank ({ranks.dcp_rank}) must equal tp_rank % dcp_size = "
                        f"{ranks.tp_rank} % {config.dcp_size} = {ranks.tp_rank % config.dcp_size}")


def validate_step(step: StepSpec, config: CPConfig, num_blocks: int | None = None) -> None:
    """Checks of a step before it is planned (same on every rank). Costs O(R x max_blocks).

    Beyond ``StepSpec`` and ``MetadataBuilder._check_block_table``: block ids are in
    ``[0, num_blocks)``, no request lists one block twice, and no block written this step is
    used by another request of the step (two writers of one slot corrupt the cache; blocks
    only read, e.g. shared prefix blocks, may be shared).
    """
    table = step.block_table.detach().cpu().numpy().astype(np.int64)
    seq_lens = step.seq_lens
    needed = KVSharding.of(config).blocks_needed(seq_lens)
    have = table.shape[1]
    virtual = config.block_size * config.kv_world
    for r in range(step.num_reqs):
        if needed[r] > have:
            raise StepError(f"block_table[{r}] has {have} blocks but request {r} needs "
                            f"{int(needed[r])} for {int(seq_lens[r])} tokens ({virtual} per block)")
    if num_blocks is not None and (not is_int(num_blocks) or num_blocks < 1):
        raise StepError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
    written: dict[int, int] = {}  # block -> request writing it this step
    for r in range(step.num_reqs):
        used = table[r, :needed[r]]
        for j, block in enumerate(used.tolist()):
            if block < 0:
                raise StepError(f"block_table[{r}, {j}] = {block} is a negative block id")
            if num_blocks is not None and block >= num_blocks:
                raise StepError(f"block_table[{r}, {j}] = {block} is outside [0, "
                                f"num_blocks={num_blocks})")
        values, counts = np.unique(used, return_counts=True)
        if (counts > 1).any():
            raise StepError(f"block_table[{r}] lists block {int(values[counts > 1][0])} twice: "
                            "two positions of one request would share cache slots")
        for block in used[step.num_computed_tokens[r] // virtual:].tolist():
            written.setdefault(block, r)
    for r2 in range(step.num_reqs):
        for block in table[r2, :needed[r2]].tolist():
            r = written.get(block, r2)
            if r != r2:
                raise StepError(f"block {block} is written by request {r} and also used by "
                                f"request {r2} in the same step (cache corruption)")


def _expected_rows(step: StepSpec, config: CPConfig) -> tuple[np.ndarray, np.ndarray]:
    """(request, offset) of every step row: decode rows, then each prefill padded to 2*pcp*c."""
    scheduled = step.scheduled
    is_decode = decode_mask(step, config.decode_threshold)
    reqs, offs = [], []
    for r in np.nonzero(is_decode)[0]:
        reqs += [r] * scheduled[r]
        offs += list(range(scheduled[r]))
    for r in np.nonzero(~is_decode)[0]:
        n = scheduled[r]
        padded = n if config.pcp_size == 1 else ceil_div(n, 2 * config.pcp_size) * 2 * config.pcp_size
        reqs += [r] * padded
        offs += list(range(padded))
    return np.asarray(reqs, dtype=np.int64), np.asarray(offs, dtype=np.int64)


def validate_rank_plans(step: StepSpec, config: CPConfig, metas: dict) -> None:
    """Invariants of one step's metadata over every (pcp_rank, dcp_rank) (raises StepError).

    metas: ``{(pcp_rank, dcp_rank): AttentionMetadata}`` of every rank (the builder module
    imports this one, so the type is named here only).

    * every step token is written exactly once per KV shard group, at its slot (docs/dcp.md 1);
    * the union of real local rows over PCP ranks is every step token, decodes on every rank;
    * restore / scatter indices are inverse permutations, gathered[restore] is request order;
    * context lengths sum to num_computed_tokens; index tensors are in range.
    """
    cfg = config
    computed, scheduled = step.computed, step.scheduled
    cu_new = step.cu_new_tokens
    table = step.block_table.cpu().numpy().astype(np.int64)
    sharding = KVSharding.of(cfg)
    row_req, row_off = _expected_rows(step, cfg)
    row_real = row_off < scheduled[row_req]
    token_pos = computed[row_req] + row_off
    num_new = step.num_new_tokens

    def fail(msg: str) -> None:
        raise StepError(msg)

    groups = [[(p, d) for p in range(cfg.pcp_size) for d in range(cfg.dcp_size)]] \
        if cfg.kv_shard == "cp" else [[(p, d) for d in range(cfg.dcp_size)]
                                      for p in range(cfg.pcp_size)]
    for members in groups:
        writes = np.zeros(num_new, dtype=np.int64)
        for p, d in members:
            meta = metas[(p, d)]
            slots = meta.step_slot_mapping.numpy()
            if len(slots) != len(row_req):
                fail(f"rank ({p},{d}): step_slot_mapping has {len(slots)} rows, expected "
                     f"{len(row_req)}")
            shard = cfg.kv_rank(p, d)
            expect = sharding.slots(np.where(row_real, row_req, -1), token_pos, table, shard)
            if not np.array_equal(slots, expect):
                i = int(np.nonzero(slots != expect)[0][0])
                fail(f"rank ({p},{d}): step row {i} (request {row_req[i]}, position "
                     f"{token_pos[i]}) has slot {slots[i]}, expected {expect[i]}")
            np.add.at(writes, (cu_new[row_req] + row_off)[slots >= 0], 1)
        if not (writes == 1).all():
            t = int(np.nonzero(writes != 1)[0][0])
            fail(f"KV group {members}: token {t} written {int(writes[t])} times")

    for d in range(cfg.dcp_size):
        seen = np.zeros(num_new, dtype=np.int64)
        decode_tokens = None
        for p in range(cfg.pcp_size):
            meta = metas[(p, d)]
            idx = meta.local_token_idx.numpy()
            pos = meta.positions.numpy()
            real = idx >= 0
            req = np.searchsorted(cu_new, np.where(real, idx, 0), side="right") - 1
            if not np.array_equal(pos[real], computed[req[real]] + idx[real] - cu_new[req[real]]):
                fail(f"rank ({p},{d}): positions do not match local_token_idx")
            if (pos[~real] != 0).any():
                fail(f"rank ({p},{d}): pad rows have non-zero positions")
            pads = ~real[:meta.num_local_rows]
            if (meta.pad_rows is None and pads.any()) or (
                    meta.pad_rows is not None and not np.array_equal(meta.pad_rows.numpy(), pads)):
                fail(f"rank ({p},{d}): pad_rows disagrees with local_token_idx")
            dec = idx[:meta.num_decode_tokens]
            decode_tokens = dec if decode_tokens is None else decode_tokens
            if not np.array_equal(dec, decode_tokens) or (dec < 0).any():
                fail(f"rank ({p},{d}): decode rows differ between PCP ranks or hold pads")
            np.add.at(seen, idx[meta.num_decode_tokens:][real[meta.num_decode_tokens:]], 1)
            _check_rank_ranges(meta, cfg, computed, p, d, fail)
        np.add.at(seen, decode_tokens, 1)
        if not (seen == 1).all():
            t = int(np.nonzero(seen != 1)[0][0])
            fail(f"dcp_rank {d}: token {t} computed on {int(seen[t])} rows over PCP ranks")

    ctx_total = np.zeros(step.num_reqs, dtype=np.int64)
    order = np.concatenate([metas[(0, 0)].decode_reqs, metas[(0, 0)].prefill_reqs])
    for (p, d), meta in metas.items():
        if cfg.kv_shard == "dcp" and p:
            continue
        ctx_total[order] += meta.ctx_seq_lens.numpy()
    if not np.array_equal(ctx_total, computed):
        fail(f"context lengths over shards sum to {ctx_total.tolist()}, expected {computed.tolist()}")


def _check_rank_ranges(meta, cfg: CPConfig, computed: np.ndarray, p: int,
                       d: int, fail) -> None:
    """Per-rank lengths, cu_seqlens and index ranges of one rank's ``AttentionMetadata``."""
    where = f"rank ({p},{d})"
    if meta.pcp_partition is not None:
        rows = meta.chunk_q_idx.numel()
        total = cfg.pcp_size * rows
        restore = meta.pcp_allgather_restore_idx.numpy()
        scatter = meta.pcp_allgather_scatter_idx.numpy()
        if not np.array_equal(np.sort(restore), np.arange(total)):
            fail(f"{where}: pcp_allgather_restore_idx is not a permutation of {total} rows")
        if not np.array_equal(restore[scatter], np.arange(total)):
            fail(f"{where}: pcp_allgather_scatter_idx is not the inverse of the restore index")
        restored_req, restored_pos = meta.pcp_partition.restored_rows(meta.chunk_lens)
        if (np.diff(restored_req * (1 << 32) + restored_pos) <= 0).any():
            fail(f"{where}: restored rows are not in request order")
        q_all = meta.chunk_q_idx.numpy().reshape(-1)
        if not np.array_equal(np.sort(q_all), np.arange(rows)):
            fail(f"{where}: chunk_q_idx does not cover the {rows} local rows once")
        m, local_cu = len(meta.chunk_q_idx), meta.local_chunk_cu_seqlens.numpy()
        # local_cu[s:-1:m]: the first local row of chunk s of each prefill
        if len(local_cu) != m * len(meta.chunk_lens) + 1 or local_cu[-1] != rows or any(
                not np.array_equal(ranges_concat(local_cu[s:-1:m], meta.chunk_lens),
                                   meta.chunk_q_idx.numpy()[s]) for s in range(m)):
            fail(f"{where}: local_chunk_cu_seqlens does not delimit the rows of chunk_q_idx")
        before = meta.chunk_keys_before.numpy()  # the chunk's own c keys follow
        if (before < 0).any() or (before + meta.chunk_lens > meta.padded_lens).any():
            fail(f"{where}: chunk_keys_before + c exceeds a prefill's restored rows")
        if meta.num_local_rows != meta.num_decode_tokens + rows:
            fail(f"{where}: num_local_rows {meta.num_local_rows} != decodes "
                 f"{meta.num_decode_tokens} + local prefill rows {rows}")
    for name in ("decode_cu_seqlens", "prefill_cu_seqlens", "ctx_cu_seqlens"):
        cu = getattr(meta, name).numpy()
        if cu[0] != 0 or (np.diff(cu) < 0).any():
            fail(f"{where}: {name} = {cu.tolist()} is not non-decreasing from 0")
    if meta.decode_cu_seqlens.numpy()[-1] != meta.num_decode_tokens:
        fail(f"{where}: decode_cu_seqlens ends at {meta.decode_cu_seqlens[-1]}, "
             f"num_decode_tokens={meta.num_decode_tokens}")
    expected_ctx = meta.num_decode_tokens + (cfg.pcp_size if meta.ctx_over_pcp else 1) * (
        meta.num_local_rows - meta.num_decode_tokens)
    if meta.ctx_cu_seqlens.numpy()[-1] != expected_ctx:
        fail(f"{where}: ctx_cu_seqlens ends at {meta.ctx_cu_seqlens[-1]}, expected {expected_ctx}")
    shard = cfg.kv_rank(p, d)
    order = np.concatenate([meta.decode_reqs, meta.prefill_reqs])
    lens = KVSharding.of(cfg).local_count(computed[order], shard)
    if not np.array_equal(meta.ctx_seq_lens.numpy(), lens):
        fail(f"{where}: ctx_seq_lens {meta.ctx_seq_lens.tolist()} != {lens.tolist()}")
    if meta.ctx_kv_start is not None:
        start, end = meta.ctx_kv_start.numpy(), meta.ctx_kv_end.numpy()
        rows_len = np.repeat(lens, np.diff(meta.ctx_cu_seqlens.numpy()))
        if (start < 0).any() or (start > end).any() or (end > rows_len).any():
            fail(f"{where}: ctx_kv_start/ctx_kv_end outside [0, local context length]")
