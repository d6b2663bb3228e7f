"""KV ownership map (docs/dcp.md section 1) and the DCP/PCP context metadata, against brute force.

Pure index math: no processes. Every property is checked against an explicit per-token
enumeration, so a wrong formula in ``metadata/kv_layout.py`` or ``metadata/builder.py`` fails.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.builder import MetadataBuilder
from cp_attention.metadata.common import StepSpec, ranges_concat
from cp_attention.metadata.kv_layout import KVSharding
from cp_attention.metadata.vllm_ascend import VllmAscendView


# -- KVSharding under the (positions, world, interleave) signatures the checks below use -------
def kv_owner(positions, world, interleave):
    return KVSharding(world, interleave).owner(positions)


def local_position(positions, world, interleave):
    return KVSharding(world, interleave).local_position(positions)


def local_count(lengths, shard, world, interleave):
    return KVSharding(world, interleave).local_count(lengths, shard)


def local_kv_lens(lengths, world, interleave):
    """[R, world] local count of each request on each shard."""
    return KVSharding(world, interleave).local_count(np.asarray(lengths)[:, None],
                                                     np.arange(world)[None, :])


def blocks_needed(lengths, block_size, world):
    return KVSharding(world, 1, block_size).blocks_needed(lengths)


def slot_mapping(req, pos, table, block_size, world, shard, interleave):
    return KVSharding(world, interleave, block_size).slots(req, pos, table, shard)


def segment_slots(req, first_row, first_pos, tokens, rows, table, block_size, world, shard,
                  interleave):
    return KVSharding(world, interleave, block_size).segment_slots(req, first_row, first_pos,
                                                                   tokens, rows, table, shard)


SETTINGS = settings(derandomize=True, deadline=None, max_examples=150)
WORLDS = st.integers(1, 8)
INTERLEAVES = st.sampled_from([1, 2, 4, 16])


# -- brute force ----------------------------------------------------------------------------
def brute_owner(t: int, world: int, interleave: int) -> int:
    """Walk the tokens in runs of ``interleave``, dealing the runs round-robin to the shards."""
    return (t // interleave) % world


def brute_local_lists(length: int, world: int, interleave: int) -> list[list[int]]:
    """Global positions stored by each shard, in the order the shard stores them."""
    owned: list[list[int]] = [[] for _ in range(world)]
    for t in range(length):
        owned[brute_owner(t, world, interleave)].append(t)
    return owned


def brute_count(lo: int, hi: int, shard: int, world: int, interleave: int) -> int:
    return sum(1 for t in range(lo, hi) if brute_owner(t, world, interleave) == shard)


# -- ownership and slots --------------------------------------------------------------------
@SETTINGS
@given(world=WORLDS, interleave=INTERLEAVES, length=st.integers(0, 600))
def test_owner_and_local_position_match_enumeration(world, interleave, length):
    positions = np.arange(length)
    owners = kv_owner(positions, world, interleave)
    local = local_position(positions, world, interleave)
    for shard, tokens in enumerate(brute_local_lists(length, world, interleave)):
        assert np.array_equal(np.nonzero(owners == shard)[0], tokens)
        # A shard stores its tokens densely, in global order: local positions 0..n-1.
        assert np.array_equal(local[tokens], np.arange(len(tokens)))


@SETTINGS
@given(world=WORLDS, interleave=INTERLEAVES,
       lengths=st.lists(st.integers(0, 1000), min_size=1, max_size=6))
def test_local_count_matches_brute_force(world, interleave, lengths):
    expected = np.array([[len(ts) for ts in brute_local_lists(n, world, interleave)]
                         for n in lengths])
    assert np.array_equal(local_kv_lens(np.array(lengths), world, interleave), expected)
    for shard in range(world):
        assert np.array_equal(local_count(np.array(lengths), shard, world, interleave),
                              expected[:, shard])
    assert np.array_equal(expected.sum(axis=1), lengths)  # every token counted once


@pytest.mark.parametrize("length, world, interleave, expected", [
    (10, 4, 1, [3, 3, 2, 2]),
    (10, 2, 4, [6, 4]),
    (19, 4, 2, [6, 5, 4, 4]),  # the worked example of docs/dcp.md
    (3, 8, 16, [3, 0, 0, 0, 0, 0, 0, 0]),  # shorter than one interleave run: one shard has all
    (0, 4, 1, [0, 0, 0, 0]),
])
def test_local_kv_lens_examples(length, world, interleave, expected):
    assert local_kv_lens(np.array([length]), world, interleave)[0].tolist() == expected


@SETTINGS
@given(world=WORLDS, interleave=INTERLEAVES, mult=st.sampled_from([1, 2, 8]),
       lengths=st.lists(st.integers(0, 400), min_size=1, max_size=5), seed=st.integers(0, 2**16),
       spare_cols=st.integers(0, 2))
def test_every_token_stored_once_on_owner_in_own_blocks(world, interleave, mult, lengths, seed,
                                                         spare_cols):
    block_size = interleave * mult
    lengths = np.array(lengths)
    needed = blocks_needed(lengths, block_size, world)
    assert np.array_equal(needed, [-(-n // (block_size * world)) for n in lengths])
    cols = int(needed.max()) + spare_cols
    rng = np.random.default_rng(seed)
    perm = rng.permutation(int(needed.sum()) + 3)  # distinct blocks, shuffled
    table = np.full((len(lengths), max(cols, 1)), -1, dtype=np.int64)
    start = 0
    for r, n in enumerate(needed):
        table[r, :n] = perm[start:start + n]
        start += n
    req = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths]) if len(req) else np.zeros(0, np.int64)
    # Padding rows (req -1) must never be stored.
    req = np.concatenate([req, [-1, -1]])
    pos = np.concatenate([pos, [0, 5]])
    slots = np.stack([slot_mapping(req, pos, table, block_size, world, s, interleave)
                      for s in range(world)])  # [world, T]
    stored = slots >= 0
    real = req >= 0
    assert not stored[:, ~real].any()
    assert np.array_equal(stored.sum(axis=0)[real], np.ones(real.sum()))  # exactly once
    for t in np.nonzero(real)[0]:
        r, p = req[t], pos[t]
        shard = brute_owner(p, world, interleave)
        assert stored[shard, t]
        local = brute_local_lists(p + 1, world, interleave)[shard].index(p)
        block, offset = divmod(int(slots[shard, t]), block_size)
        assert block == table[r, local // block_size]  # one of the request's own blocks
        assert offset == local % block_size
        assert block in table[r, :needed[r]]
    for shard in range(world):  # distinct slots on every shard
        mine = slots[shard][stored[shard]]
        assert len(np.unique(mine)) == len(mine)


@SETTINGS
@given(segments=st.lists(st.tuples(st.integers(-5, 50), st.integers(0, 40)), max_size=8))
def test_ranges_concat_matches_python(segments):
    starts = np.array([s for s, _ in segments], dtype=np.int64)
    lengths = np.array([n for _, n in segments], dtype=np.int64)
    expected = [s + j for s, n in segments for j in range(n)]
    out = ranges_concat(starts, lengths)
    assert out.dtype == np.int64 and out.tolist() == expected


@SETTINGS
@given(world=WORLDS, interleave=INTERLEAVES, mult=st.sampled_from([1, 2, 8]),
       segments=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 90), st.integers(0, 6)),
                         min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_segment_slots_equal_per_token_slot_mapping(world, interleave, mult, segments, seed):
    """The closed form per segment equals the per-row definition on every shard, pads (rows
    after a segment's tokens) included."""
    block_size = interleave * mult
    context = np.array([c for c, _, _ in segments], dtype=np.int64)
    tokens = np.array([n for _, n, _ in segments], dtype=np.int64)
    rows = tokens + np.array([p for _, _, p in segments], dtype=np.int64)  # trailing pads
    needed = blocks_needed(context + tokens, block_size, world)
    perm = np.random.default_rng(seed).permutation(int(needed.sum()) + 3)
    table = np.full((len(segments), max(int(needed.max()), 1)), -1, dtype=np.int32)
    start = 0
    for r, n in enumerate(needed.tolist()):
        table[r, :n] = perm[start:start + n]
        start += n
    req = np.arange(len(segments), dtype=np.int64)
    first_row = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    row_req = np.repeat(req, rows)
    row_off = ranges_concat(np.zeros(len(rows), dtype=np.int64), rows)
    real = row_off < tokens[row_req]
    for shard in range(world):
        expected = slot_mapping(np.where(real, row_req, -1), context[row_req] + row_off, table,
                                block_size, world, shard, interleave)
        got = segment_slots(req, first_row, context, tokens, int(rows.sum()), table,
                            block_size, world, shard, interleave)
        assert got.dtype == np.int64
        assert np.array_equal(got, expected), shard


# -- builder: per-rank context lengths, masks and visible ranges ----------------------------
CONFIGS = [
    # (pcp, tp, dcp, kv_shard)
    (1, 2, 2, "cp"), (1, 4, 2, "cp"), (1, 4, 4, "cp"), (1, 8, 8, "cp"),
    (2, 2, 2, "cp"), (2, 4, 2, "cp"), (2, 2, 2, "dcp"), (2, 1, 1, "cp"), (4, 2, 2, "cp"),
]


def _step(computed: list[int], scheduled: list[int], cfg: CPConfig) -> StepSpec:
    seq = np.array(computed) + np.array(scheduled)
    need = blocks_needed(seq, cfg.block_size, cfg.kv_world)
    cols = max(int(need.max()), 1)
    table = torch.arange(len(computed) * cols, dtype=torch.int32).view(len(computed), cols)
    return StepSpec(tuple(computed), tuple(scheduled), table)


def _shard(cfg: CPConfig, pcp_rank: int, dcp_rank: int) -> int:
    return pcp_rank * cfg.dcp_size + dcp_rank if cfg.kv_shard == "cp" else dcp_rank


def _all_ranks(cfg: CPConfig):
    for rank in range(cfg.world_size):
        yield CPRanks.of(cfg, rank)


def _context_rows(meta, cfg: CPConfig, computed, scheduled):
    """(request, global position, real) of each context row, rebuilt from the step alone."""
    order = np.concatenate([meta.decode_reqs, meta.prefill_reqs])
    reqs, positions, real = [], [], []
    if meta.ctx_over_pcp:  # decode rows, then every prefill's padded tokens in order
        for r in order:
            n = scheduled[r]
            rows = n if r in meta.decode_reqs else -(-n // (2 * cfg.pcp_size)) * 2 * cfg.pcp_size
            for j in range(rows):
                reqs.append(r)
                positions.append(computed[r] + j)
                real.append(j < n)
        return np.array(reqs), np.array(positions), np.array(real)
    rows = meta.num_local_rows
    idx = meta.local_token_idx[:rows].numpy()
    cu = np.concatenate([[0], np.cumsum(scheduled)])
    real = idx >= 0
    reqs = np.searchsorted(cu, np.where(real, idx, 0), side="right") - 1
    return reqs, meta.positions[:rows].numpy(), real


step_strategy = st.lists(st.tuples(st.integers(0, 120), st.integers(1, 40)), min_size=1,
                         max_size=6)


@settings(derandomize=True, deadline=None, max_examples=60)
@given(config=st.sampled_from(CONFIGS), interleave=st.sampled_from([1, 2, 16]),
       reqs=step_strategy, threshold=st.sampled_from([1, 4]))
def test_builder_local_context_lengths_match_brute_force(config, interleave, reqs, threshold):
    pcp, tp, dcp, kv_shard = config
    cfg = CPConfig(pcp_size=pcp, tp_size=tp, dcp_size=dcp, block_size=16,
                   cp_kv_interleave_size=interleave, kv_shard=kv_shard,
                   decode_threshold=threshold)
    computed = [c for c, _ in reqs]
    scheduled = [n for _, n in reqs]
    step = _step(computed, scheduled, cfg)
    for ranks in _all_ranks(cfg):
        meta = MetadataBuilder(cfg, ranks).build(step)
        expected = np.array([[[brute_count(0, c, _shard(cfg, p, d), cfg.kv_world, interleave)
                               for d in range(dcp)] for p in range(pcp)] for c in computed])
        view = VllmAscendView(meta, step, cfg)  # vLLM-Ascend's names of the plan
        assert np.array_equal(view.num_computed_tokens_of_pcp_dcp, expected)
        mine = _shard(cfg, ranks.pcp_rank, ranks.dcp_rank)
        order = np.concatenate([meta.decode_reqs, meta.prefill_reqs])  # context order
        local = np.array([brute_count(0, computed[r], mine, cfg.kv_world, interleave)
                          for r in order])
        assert meta.ctx_seq_lens.tolist() == local.tolist()
        assert view.batch_seq_mask.tolist() == (local == 0).tolist()
        assert meta.ctx_kv_start is None and meta.ctx_kv_end is None  # no window: whole shard


def _check_visible_ranges(cfg: CPConfig, computed, scheduled, window: int) -> list[tuple]:
    """Assert every context row's local range; return (shard, position, lo, hi) per real row."""
    step = _step(computed, scheduled, cfg)
    seen = []
    for ranks in _all_ranks(cfg):
        meta = MetadataBuilder(cfg, ranks, sliding_window=window).build(step)
        shard = _shard(cfg, ranks.pcp_rank, ranks.dcp_rank)
        reqs, positions, real = _context_rows(meta, cfg, computed, scheduled)
        start, end = meta.ctx_kv_start.numpy(), meta.ctx_kv_end.numpy()
        assert len(start) == len(end) == len(reqs) == int(meta.ctx_cu_seqlens[-1])
        for row in range(len(reqs)):
            if not real[row]:
                assert start[row] == end[row] == 0  # pad rows see nothing
                continue
            context, p = computed[reqs[row]], positions[row]
            g_lo, g_hi = max(0, p - window + 1), min(p + 1, context)
            owned = [t for t in range(g_lo, g_hi)
                     if brute_owner(t, cfg.kv_world, cfg.cp_kv_interleave_size) == shard]
            # The shard's local slots [start, end) hold exactly the visible owned tokens.
            stored = brute_local_lists(context, cfg.kv_world, cfg.cp_kv_interleave_size)[shard]
            assert stored[start[row]:end[row]] == owned, (shard, p, start[row], end[row])
            assert 0 <= start[row] <= end[row] <= meta.ctx_seq_lens[
                list(np.concatenate([meta.decode_reqs, meta.prefill_reqs])).index(reqs[row])]
            seen.append((shard, int(p), int(start[row]), int(end[row])))
    return seen


@settings(derandomize=True, deadline=None, max_examples=60)
@given(config=st.sampled_from(CONFIGS), interleave=st.sampled_from([1, 2, 16]),
       reqs=step_strategy, threshold=st.sampled_from([1, 4]), window=st.integers(1, 64))
def test_sliding_window_local_range_matches_brute_force(config, interleave, reqs, threshold,
                                                        window):
    pcp, tp, dcp, kv_shard = config
    cfg = CPConfig(pcp_size=pcp, tp_size=tp, dcp_size=dcp, block_size=16,
                   cp_kv_interleave_size=interleave, kv_shard=kv_shard,
                   decode_threshold=threshold)
    _check_visible_ranges(cfg, [c for c, _ in reqs], [n for _, n in reqs], window)


def test_speculative_queries_with_empty_local_range():
    """k=3 speculative decode, 8 shards, interleave 16, window 3: most shards see nothing."""
    cfg = CPConfig(pcp_size=1, tp_size=8, dcp_size=8, block_size=16, cp_kv_interleave_size=16,
                   decode_threshold=4)
    computed, scheduled = [20, 40], [4, 4]
    seen = _check_visible_ranges(cfg, computed, scheduled, window=3)
    by = {(s, p): (lo, hi) for s, p, lo, hi in seen}
    # Request 0 (context 20): queries at 20..23 see global [18, 20), [19, 20), [], []
    # -> all on shard 1 (tokens 16..31), local positions 2..3.
    assert by[(1, 20)] == (2, 4) and by[(1, 21)] == (3, 4)
    assert by[(1, 22)][0] == by[(1, 22)][1] and by[(1, 23)][0] == by[(1, 23)][1]
    for shard in (0, *range(2, 8)):
        for p in range(20, 24):
            lo, hi = by[(shard, p)]
            assert lo == hi  # empty local visible range
    # Request 1 (context 40): window [38, 40) lives on shard 2 (tokens 32..47).
    assert by[(2, 40)] == (6, 8)


def test_per_query_local_length_is_not_local_of_context_minus_k():
    """Why the visible length is computed per query: local(G - k) != local(G) - k."""
    world, interleave, context = 2, 4, 10  # shard 0 holds 0-3, 8-9; shard 1 holds 4-7
    for k in range(4):
        visible = context - k  # a query seeing the first G - k cached tokens
        per_query = local_count(np.array([visible]), 0, world, interleave)[0]
        assert per_query == brute_count(0, visible, 0, world, interleave)
    naive = local_count(np.array([context]), 0, world, interleave)[0] - 3
    assert naive == 3 and local_count(np.array([context - 3]), 0, world, interleave)[0] == 4
