"""Random steps through the metadata builders of every rank, checked against the invariants of
:func:`cp_attention.metadata.checks.validate_rank_plans` (ownership, restore permutations, lengths,
index ranges). ~200 examples in CI; benchmarks/fuzz_nightly.py runs >= 10,000.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.common import StepSpec
from cp_attention.metadata.kv_layout import KVSharding
from cp_attention.errors import StepError
from cp_attention.metadata.checks import validate_rank_plans

SETTINGS = dict(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


def build_all(step: StepSpec, config: CPConfig, window: int | None, num_blocks: int) -> dict:
    """Metadata of every (pcp_rank, dcp_rank) (tp_size == dcp_size: one DCP group per PCP rank)."""
    builder_cls = CPAttentionBackend.get_builder_cls()
    metas = {}
    for p in range(config.pcp_size):
        for d in range(config.dcp_size):
            builder = builder_cls(config, CPRanks(p, d, d), window, num_blocks)
            metas[(p, d)] = builder.build(step)
    return metas


def make_step(config: CPConfig, requests: list[tuple[int, int]], extra_cols: int, seed: int
              ) -> tuple[StepSpec, int]:
    """Distinct shuffled blocks per request; returns the step and num_blocks."""
    seq = np.array([c + s for c, s in requests])
    needed = KVSharding.of(config).blocks_needed(seq)
    num_blocks = int(needed.sum()) + 3
    perm = np.random.default_rng(seed).permutation(num_blocks)
    width = int(needed.max()) + extra_cols
    table = torch.full((len(requests), width), -1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(needed.tolist()):
        table[r, :n] = torch.from_numpy(perm[start:start + n].astype(np.int32))
        start += n
    step = StepSpec(tuple(c for c, _ in requests), tuple(s for _, s in requests), table)
    return step, num_blocks


@st.composite
def cases(draw):
    pcp = draw(st.integers(1, 8))
    dcp = draw(st.sampled_from([1, 2, 4]))
    block = draw(st.sampled_from([2, 4, 8, 16, 32]))
    inter = draw(st.sampled_from([i for i in (1, 2, 4, 8, 16) if block % i == 0]))
    threshold = draw(st.integers(1, 3))
    config = CPConfig(pcp_size=pcp, dcp_size=dcp, tp_size=dcp, block_size=block,
                      cp_kv_interleave_size=inter, kv_shard=draw(st.sampled_from(["cp", "dcp"])),
                      decode_threshold=threshold)
    kinds = draw(st.lists(st.sampled_from(["decode", "prefill", "chunked"]), min_size=1,
                          max_size=6))
    requests = []
    for kind in kinds:
        if kind == "decode":  # one token or speculative tokens, with context
            requests.append((draw(st.integers(1, 300)), draw(st.integers(1, threshold))))
        elif kind == "prefill":
            requests.append((0, draw(st.integers(1, 70))))
        else:  # chunked prefill / prefix-cache hit: context and more than threshold tokens
            requests.append((draw(st.integers(1, 300)), draw(st.integers(threshold + 1, 70))))
    requests.sort(key=lambda r: not (r[0] > 0 and r[1] <= threshold))  # decodes first
    window = draw(st.one_of(st.none(), st.integers(1, 64)))
    return config, requests, window, draw(st.integers(0, 2)), draw(st.integers(0, 2 ** 16))


def check_case(config, requests, window, extra_cols, seed) -> None:
    step, num_blocks = make_step(config, requests, extra_cols, seed)
    validate_rank_plans(step, config, build_all(step, config, window, num_blocks))


@settings(max_examples=160, **SETTINGS)
@given(cases())
def test_random_steps_satisfy_plan_invariants(case) -> None:
    check_case(*case)


@settings(max_examples=40, **SETTINGS)
@given(st.integers(1, 8), st.integers(1, 80), st.sampled_from(["cp", "dcp"]))
def test_single_prefill_edges(pcp: int, tokens: int, kv_shard: str) -> None:
    """Prompts shorter than 2*pcp, of 1 token, and at block / interleave boundaries."""
    config = CPConfig(pcp_size=pcp, dcp_size=2, tp_size=2, block_size=4,
                      cp_kv_interleave_size=2, kv_shard=kv_shard)
    check_case(config, [(0, tokens)], None, 0, tokens)


def test_invariant_checker_catches_a_corrupted_plan() -> None:
    """The checker can fail: one slot moved, one token dropped, a broken restore index, a pad
    mask that lost its pads, chunk boundaries of the diagonals' call one row off."""
    config = CPConfig(pcp_size=2, dcp_size=2, tp_size=2, block_size=4)
    step, num_blocks = make_step(config, [(5, 1), (0, 13), (9, 6)], 0, 0)

    def corrupted(mutate):
        metas = build_all(step, config, None, num_blocks)
        mutate(metas)
        return metas

    def move_slot(metas):
        slots = metas[(1, 1)].step_slot_mapping
        i = int(torch.nonzero(slots >= 0)[0])
        slots[i] += 1

    def drop_token(metas):
        meta = metas[(1, 0)]
        row = int(torch.nonzero(meta.local_token_idx[meta.num_decode_tokens:] >= 0)[0])
        meta.local_token_idx[meta.num_decode_tokens + row] = -1
        meta.positions[meta.num_decode_tokens + row] = 0
        meta.pad_rows = meta.local_token_idx[:meta.num_local_rows] < 0  # consistent mask

    def forget_pad(metas):
        meta = next(m for m in metas.values() if m.pad_rows is not None)
        meta.pad_rows = None

    def break_restore(metas):
        restore = metas[(0, 0)].pcp_allgather_restore_idx
        restore[[0, 1]] = restore[[1, 0]]

    def shift_chunk_boundary(metas):
        metas[(0, 0)].local_chunk_cu_seqlens[1] += 1

    for mutate, fragment in ((move_slot, "has slot"), (drop_token, "computed on 0 rows"),
                             (break_restore, "inverse of the restore index"),
                             (forget_pad, "pad_rows disagrees"),
                             (shift_chunk_boundary, "local_chunk_cu_seqlens")):
        with pytest.raises(StepError, match=fragment):
            validate_rank_plans(step, config, corrupted(mutate))
