"""Properties of the PCP head/tail planner, checked on every rank of random steps (no processes).

The expected layouts are written here from the conventions of docs/pcp.md section 1, independently
of ``cp_attention.metadata.pcp``: a prefill of L new tokens is padded at its end to
``2 * pcp * c`` rows (``c = ceil(L / (2 * pcp))``); PCP rank r keeps chunks r (head) and
``2 * pcp - 1 - r`` (tail); decodes (context > 0, one new token) are not split and sit first
on every PCP rank; global token index = index into the step's new tokens in batch order.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.builder import AttentionMetadata, MetadataBuilder
from cp_attention.metadata.common import StepSpec, cumsum0, ranges_concat
from cp_attention.metadata.pcp import HeadTail
from cp_attention.metadata.vllm_ascend import VllmAscendView

PCP_SIZES = (2, 3, 4, 8)
SETTINGS = dict(derandomize=True, deadline=None, max_examples=60)
PAD = -1


# --------------------------------------------------------------------------------------------
# Steps and their expected layouts
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Req:
    computed: int  # tokens already cached
    new: int  # tokens scheduled this step

    @property
    def is_decode(self) -> bool:
        return self.computed > 0 and self.new == 1


@st.composite
def batches(draw, max_reqs: int = 12, max_new: int = 300, max_context: int = 200) -> list[Req]:
    """A batch of 1..max_reqs requests: decodes, fresh prefills and prefills with context,
    in random batch order."""
    reqs = []
    for _ in range(draw(st.integers(1, max_reqs))):
        kind = draw(st.sampled_from(("decode", "prefill", "prefill_ctx")))
        if kind == "decode":
            reqs.append(Req(draw(st.integers(1, max_context)), 1))
        elif kind == "prefill":
            reqs.append(Req(0, draw(st.integers(1, max_new))))
        else:  # a context hit / later chunk: at least 2 new tokens, else it is a decode
            reqs.append(Req(draw(st.integers(1, max_context)), draw(st.integers(2, max_new))))
    return reqs


def make_step(reqs: list[Req], block_size: int, kv_world: int, seed: int = 0) -> StepSpec:
    """A step whose requests own distinct, shuffled virtual blocks."""
    needed = [-(-(r.computed + r.new) // (block_size * kv_world)) for r in reqs]
    width = max(needed)
    perm = np.random.default_rng(seed).permutation(sum(needed) + 3)
    table = torch.full((len(reqs), width), -1, dtype=torch.int64)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = torch.from_numpy(perm[start:start + n])
        start += n
    return StepSpec(tuple(r.computed for r in reqs), tuple(r.new for r in reqs), table)


def token_offsets(reqs: list[Req]) -> list[int]:
    """Global index of each request's first new token."""
    return [sum(r.new for r in reqs[:i]) for i in range(len(reqs))]


def chunk_of(req: Req, pcp: int) -> int:
    return -(-req.new // (2 * pcp))


def expected_decode_tokens(reqs: list[Req]) -> list[int]:
    offsets = token_offsets(reqs)
    return [offsets[i] for i, r in enumerate(reqs) if r.is_decode]


def expected_restored(reqs: list[Req], pcp: int) -> list[int]:
    """Restored prefill rows: each prefill's tokens in order, then its pads."""
    rows: list[int] = []
    for off, r in zip(token_offsets(reqs), reqs):
        if not r.is_decode:
            padded = 2 * pcp * chunk_of(r, pcp)
            rows += [off + j for j in range(r.new)] + [PAD] * (padded - r.new)
    return rows


def expected_local(reqs: list[Req], pcp: int, rank: int) -> tuple[list[int], list[int]]:
    """(token, position) of each local prefill row of ``rank``: per prefill [head, tail]."""
    tokens, positions = [], []
    for off, r in zip(token_offsets(reqs), reqs):
        if r.is_decode:
            continue
        c = chunk_of(r, pcp)
        for chunk in (rank, 2 * pcp - 1 - rank):
            for j in range(c):
                p = chunk * c + j
                real = p < r.new
                tokens.append(off + p if real else PAD)
                positions.append(r.computed + p if real else 0)
    return tokens, positions


def build_all(reqs: list[Req], cfg: CPConfig, seed: int = 0, window: int | None = None
              ) -> tuple[StepSpec, dict[tuple[int, int], AttentionMetadata]]:
    """Metadata of every (pcp_rank, dcp_rank) for one step (tp_size == dcp_size)."""
    step = make_step(reqs, cfg.block_size, cfg.kv_world, seed)
    metas = {(p, d): MetadataBuilder(cfg, CPRanks(p, d, d), window).build(step)
             for p in range(cfg.pcp_size) for d in range(cfg.dcp_size)}
    return step, metas


def lst(t: torch.Tensor) -> list:
    return t.tolist()


def plan_pcp_split(new_lens, pcp: int, rank: int) -> SimpleNamespace:
    """The HeadTail split of prefills of ``new_lens`` new tokens for ``rank``: the PCP fields of
    a metadata (``HeadTail.plan``) with the strategy, its chunk and padded lengths."""
    partition, new_lens = HeadTail(pcp), np.asarray(new_lens, dtype=np.int64)
    c = partition.chunk_lens(new_lens)
    return SimpleNamespace(pcp_partition=partition, pcp_rank=rank, chunk_lens=c,
                           padded_lens=partition.num_chunks * c,
                           **partition.plan(new_lens, rank))


def ascend(split) -> VllmAscendView:
    """vLLM-Ascend's names of a split (the view of a plan holding only the PCP fields)."""
    return VllmAscendView(split)


# --------------------------------------------------------------------------------------------
# Ownership, restore, head/tail index sets, positions
# --------------------------------------------------------------------------------------------
@settings(**SETTINGS)
@given(reqs=batches(), pcp=st.sampled_from(PCP_SIZES))
def test_every_token_owned_once_and_decodes_on_every_rank(reqs, pcp):
    step, metas = build_all(reqs, CPConfig(pcp_size=pcp))
    decodes = expected_decode_tokens(reqs)
    prefill_tokens = [t for t in expected_restored(reqs, pcp) if t != PAD]
    seen: list[int] = []
    for rank in range(pcp):
        meta = metas[(rank, 0)]
        idx = lst(meta.local_token_idx)
        nd = meta.num_decode_tokens
        assert nd == len(decodes)
        assert idx[:nd] == decodes  # same decode rows, first, on every PCP rank
        assert all(PAD <= t < step.num_new_tokens for t in idx)
        seen += [t for t in idx[nd:] if t != PAD]
    assert sorted(seen) == sorted(prefill_tokens)  # each prefill token on exactly one rank
    assert len(set(seen)) == len(seen)


@settings(**SETTINGS)
@given(reqs=batches(), pcp=st.sampled_from(PCP_SIZES))
def test_restore_after_gather_is_request_order(reqs, pcp):
    _, metas = build_all(reqs, CPConfig(pcp_size=pcp))
    # Simulated all-gather of each rank's local prefill rows, rank-major.
    gathered = torch.cat([metas[(r, 0)].local_token_idx[metas[(r, 0)].num_decode_tokens:]
                          for r in range(pcp)])
    expected = expected_restored(reqs, pcp)
    for rank in range(pcp):
        split = metas[(rank, 0)]
        restore = split.pcp_allgather_restore_idx
        assert restore.dtype == torch.int64
        assert sorted(lst(restore)) == list(range(len(gathered)))  # a permutation
        assert lst(gathered[restore]) == expected
        assert torch.equal(gathered[restore][split.pcp_allgather_scatter_idx], gathered)


@settings(**SETTINGS)
@given(reqs=batches(), pcp=st.sampled_from(PCP_SIZES))
def test_local_rows_positions_and_head_tail_index_sets(reqs, pcp):
    # A window wider than any request (the windowed call reads k c + c keys of each prefill).
    _, metas = build_all(reqs, CPConfig(pcp_size=pcp), window=10_000)
    restored = torch.tensor(expected_restored(reqs, pcp), dtype=torch.int64)
    prefills = [(off, r) for off, r in zip(token_offsets(reqs), reqs) if not r.is_decode]
    chunks = [chunk_of(r, pcp) for _, r in prefills]
    for rank in range(pcp):
        meta = metas[(rank, 0)]
        split, nd = VllmAscendView(meta), meta.num_decode_tokens
        tokens, positions = expected_local(reqs, pcp, rank)
        local = meta.local_token_idx[nd:]
        assert lst(local) == tokens
        assert lst(meta.positions[nd:]) == positions
        assert lst(meta.prefill_cu_seqlens) == list(np.cumsum([0] + [2 * c for c in chunks]))
        # q_head/q_tail pick the head and tail chunks; q_full_idx undoes their concatenation.
        heads = torch.cat([local[q] for q in (split.q_head_idx, split.q_tail_idx)])
        assert torch.equal(heads[split.q_full_idx], local)
        assert len(split.q_head_idx) == len(split.q_tail_idx) == sum(chunks)
        n_local = 2 * sum(chunks)
        for name in ("q_head_idx", "q_tail_idx", "q_full_idx"):
            values = lst(getattr(split, name))
            assert all(0 <= v < n_local for v in values), name
        assert sorted(lst(split.q_full_idx)) == list(range(n_local))
        # K/V index sets (into the restored rows) are the expected chunk ranges.
        for slot, kind, chunk in ((0, "head", rank), (1, "tail", 2 * pcp - 1 - rank)):
            nomask = getattr(split, f"kv_with_q_{kind}_nomask_idx")
            mask = getattr(split, f"kv_with_q_{kind}_mask_idx")
            used = meta.chunk_keys_before[slot].numpy() + np.array(chunks, dtype=np.int64)
            both = torch.from_numpy(ranges_concat(
                cumsum0(meta.padded_lens)[:-1], used))  # the windowed call's keys
            seqlens = getattr(split, f"{kind}_attn_nomask_seqlens")
            for idx in (nomask, mask, both):
                assert all(0 <= v < len(restored) for v in lst(idx))
            exp_nomask, exp_mask, exp_both = [], [], []
            for (off, r), c in zip(prefills, chunks):
                req_rows = [off + p if p < r.new else PAD for p in range(2 * pcp * c)]
                exp_nomask += req_rows[:chunk * c]
                exp_mask += req_rows[chunk * c:(chunk + 1) * c]
                exp_both += req_rows[:(chunk + 1) * c]
            assert lst(restored[nomask]) == exp_nomask
            assert lst(restored[mask]) == exp_mask
            assert lst(restored[both]) == exp_both
            # The masked keys are exactly the chunk's own queries.
            q_idx = getattr(split, f"q_{kind}_idx")
            assert torch.equal(restored[mask], local[q_idx])
            assert lst(seqlens) == [chunks, [chunk * c for c in chunks]]
            # A real query's unmasked keys are all real tokens (pads only trail a request).
            for (off, r), c, start in zip(prefills, chunks, np.cumsum([0] + [chunk * c for c in chunks])):
                if chunk * c < r.new:
                    assert PAD not in lst(restored[nomask][start:start + chunk * c])
        assert lst(split.attn_mask_seqlens) == [chunks, chunks]


@pytest.mark.parametrize("pcp", PCP_SIZES)
def test_prefill_free_step_has_empty_split(pcp):
    """A decode-only step: every rank holds the same decode rows and no prefill rows."""
    reqs = [Req(5, 1), Req(17, 1), Req(1, 1)]
    _, metas = build_all(reqs, CPConfig(pcp_size=pcp))
    for rank in range(pcp):
        meta = metas[(rank, 0)]
        assert lst(meta.local_token_idx) == [0, 1, 2]
        assert lst(meta.positions) == [5, 17, 1]
        assert meta.num_local_prefill_rows == 0 and meta.chunk_q_idx.numel() == 0
        assert len(meta.pcp_allgather_restore_idx) == 0


@pytest.mark.parametrize("pcp", PCP_SIZES)
def test_rank_with_only_padding(pcp):
    """A prompt shorter than pcp leaves the last ranks with pad rows only."""
    reqs = [Req(0, max(1, pcp - 1))]
    _, metas = build_all(reqs, CPConfig(pcp_size=pcp))
    last = metas[(pcp - 1, 0)]
    assert lst(last.local_token_idx) == [PAD, PAD]
    assert lst(last.positions) == [0, 0]


# --------------------------------------------------------------------------------------------
# Load balance of causal work
# --------------------------------------------------------------------------------------------
def causal_work(metas: dict, pcp: int) -> np.ndarray:
    """Per PCP rank: sum over local prefill query rows of (position + 1)."""
    work = []
    for rank in range(pcp):
        meta = metas[(rank, 0)]
        nd = meta.num_decode_tokens
        real = meta.local_token_idx[nd:] >= 0
        work.append(int((meta.positions[nd:][real] + 1).sum()))
    return np.array(work, dtype=np.float64)


def contiguous_work(reqs: list[Req], pcp: int) -> np.ndarray:
    """The same measure when each prompt is cut into pcp contiguous pieces instead."""
    work = np.zeros(pcp)
    for r in reqs:
        piece = -(-r.new // pcp)
        for p in range(r.new):
            work[p // piece] += r.computed + p + 1
    return work


def imbalance(work: np.ndarray) -> float:
    return float(work.max() / work.mean())


@settings(**SETTINGS)
@given(data=st.data(), pcp=st.sampled_from(PCP_SIZES))
def test_padded_head_tail_work_is_exactly_equal(data, pcp):
    """Counting pad rows at their padded positions, every rank does the same causal work."""
    reqs = data.draw(batches(max_reqs=6).map(lambda rs: [r for r in rs if not r.is_decode]))
    if not reqs:
        reqs = [Req(0, 7)]
    work = []
    for rank in range(pcp):
        partition = HeadTail(pcp)
        req, pos = partition.local_rows(partition.chunk_lens(np.array([r.new for r in reqs])),
                                        rank)
        ctx = np.array([r.computed for r in reqs])[req]
        work.append(int((ctx + pos + 1).sum()))
    assert len(set(work)) == 1, work


@settings(**SETTINGS)
@given(data=st.data(), pcp=st.sampled_from(PCP_SIZES))
def test_causal_work_balanced_for_long_prompts(data, pcp):
    """Real-token causal work. In the padded layout every rank does the same work W = c (Lp + 1)
    per prompt; the <= 2 pcp - 1 pads of a prompt all fall in rank 0's tail chunk and remove
    less than (2 pcp - 1) / (pcp c) of the mean, so max/mean <= 1 / (1 - (2 pcp - 1) / (pcp c)):
    <= 1 / (1 - (2 pcp - 1) / (32 pcp)) (1.049 .. 1.062) for prompts >= 64 pcp, and <= 1.02 for
    prompts >= 200 pcp. The contiguous split is far worse: about (2 pcp - 1) / pcp."""
    lengths = data.draw(st.lists(st.integers(64 * pcp, 64 * pcp + 400), min_size=1, max_size=4))
    context = data.draw(st.lists(st.integers(0, 500), min_size=len(lengths),
                                 max_size=len(lengths)))
    reqs = [Req(c, n) for c, n in zip(context, lengths)]
    _, metas = build_all(reqs, CPConfig(pcp_size=pcp))
    ratio = imbalance(causal_work(metas, pcp))
    assert ratio <= 1 / (1 - (2 * pcp - 1) / (32 * pcp))
    if all(n >= 200 * pcp for n in lengths):
        assert ratio <= 1.02
    # Without context the contiguous split approaches (2p - 1) / p (1.5 for p=2, 1.875 for 8).
    fresh = [Req(0, n) for n in lengths]
    assert imbalance(contiguous_work(fresh, pcp)) >= 0.9 * (2 * pcp - 1) / pcp


@pytest.mark.parametrize("pcp", PCP_SIZES)
def test_causal_work_balance_at_200_pcp(pcp):
    """Lengths just above 200 * pcp (including maximal padding) meet 1.02; just above 64 * pcp
    the worst case is well above it (1.047 for pcp=2, L=129)."""
    for n in range(200 * pcp, 200 * pcp + 2 * pcp + 1):
        _, metas = build_all([Req(0, n)], CPConfig(pcp_size=pcp))
        assert imbalance(causal_work(metas, pcp)) <= 1.02, n
        assert imbalance(contiguous_work([Req(0, n)], pcp)) > 1.45
    _, metas = build_all([Req(0, 64 * pcp + 1)], CPConfig(pcp_size=pcp))
    assert imbalance(causal_work(metas, pcp)) > 1.04


# --------------------------------------------------------------------------------------------
# Slot mapping: every token stored exactly once per KV shard group
# --------------------------------------------------------------------------------------------
def expected_step_rows(reqs: list[Req], pcp: int) -> list[tuple[int, int]]:
    """(request, global position) of each step row: decode rows, then restored prefill rows;
    (-1, -1) for pads."""
    rows = [(i, r.computed) for i, r in enumerate(reqs) if r.is_decode]
    for i, r in enumerate(reqs):
        if not r.is_decode:
            padded = 2 * pcp * chunk_of(r, pcp)
            rows += [(i, r.computed + p) if p < r.new else (-1, -1) for p in range(padded)]
    return rows


@settings(**SETTINGS)
@given(reqs=batches(max_reqs=8), pcp=st.sampled_from(PCP_SIZES), dcp=st.sampled_from((1, 2)),
       kv_shard=st.sampled_from(("cp", "dcp")), layout=st.sampled_from(((16, 1), (16, 16),
                                                                         (32, 4), (128, 16))))
def test_slot_mapping_stores_every_token_once(reqs, pcp, dcp, kv_shard, layout):
    block_size, interleave = layout
    cfg = CPConfig(pcp_size=pcp, dcp_size=dcp, tp_size=dcp, block_size=block_size,
                   cp_kv_interleave_size=interleave, kv_shard=kv_shard)
    step, metas = build_all(reqs, cfg)
    table = step.block_table.numpy()
    rows = expected_step_rows(reqs, pcp)
    world = pcp * dcp if kv_shard == "cp" else dcp
    stored: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for (p, d), meta in metas.items():
        slots = lst(meta.step_slot_mapping)
        assert len(slots) == len(rows)
        shard = p * dcp + d if kv_shard == "cp" else d
        real_slots = [s for s in slots if s >= 0]
        assert len(set(real_slots)) == len(real_slots)  # no two tokens share a slot
        for (req, pos), slot in zip(rows, slots):
            if req < 0:
                assert slot == -1  # pads are never stored
                continue
            owner = (pos // interleave) % world
            if owner != shard:
                assert slot == -1
                continue
            local = (pos // (interleave * world)) * interleave + pos % interleave
            assert slot == table[req, local // block_size] * block_size + local % block_size
            stored.setdefault((req, pos), []).append((p, d, slot))
    real = [(req, pos) for req, pos in rows if req >= 0]
    assert sorted(stored) == sorted(real)
    for token, where in stored.items():
        if kv_shard == "cp":
            assert len(where) == 1, (token, where)  # one shard of the pcp*dcp group
        else:
            assert sorted(w[0] for w in where) == list(range(pcp)), (token, where)  # each PCP rank once


# --------------------------------------------------------------------------------------------
# Closed-form indices against their definitions (argsort over every rank's rows)
# --------------------------------------------------------------------------------------------
def argsort_restore(new_lens: list[int], pcp: int) -> np.ndarray:
    """The definition: gather every rank's local rows rank-major, tag each with (prefill,
    padded position), and stable-argsort the tags into request order."""
    chunks = [-(-n // (2 * pcp)) for n in new_lens]
    tags = []
    for rank in range(pcp):
        for i, c in enumerate(chunks):
            for chunk in (rank, 2 * pcp - 1 - rank):
                tags += [(i, chunk * c + j) for j in range(c)]
    return np.array(sorted(range(len(tags)), key=lambda row: tags[row]), dtype=np.int64)


new_lens_lists = st.lists(st.integers(1, 200), min_size=0, max_size=6)


@settings(**SETTINGS)
@given(new_lens=new_lens_lists, pcp=st.integers(1, 8), data=st.data())
def test_closed_form_restore_and_scatter_equal_argsort(new_lens, pcp, data):
    rank = data.draw(st.integers(0, pcp - 1))
    split = plan_pcp_split(np.array(new_lens, dtype=np.int64), pcp, rank)
    expected = argsort_restore(new_lens, pcp)
    restore = split.pcp_allgather_restore_idx.numpy()
    assert np.array_equal(restore, expected)
    assert np.array_equal(split.pcp_allgather_scatter_idx.numpy(), np.argsort(expected))
    runs = split.pcp_partition.restore_runs(split.chunk_lens)  # [P, 2 pcp] first gathered rows
    assert np.array_equal(ranges_concat(runs.reshape(-1), split.chunk_lens.repeat(2 * pcp)),
                          expected)


@settings(**SETTINGS)
@given(new_lens=new_lens_lists, pcp=st.integers(1, 8), data=st.data())
def test_split_indices_in_range_and_offsets_match_lengths(new_lens, pcp, data):
    """Every index in range, q_full_idx = argsort(cat(q_head, q_tail)), the cumulative offsets
    and used-key counts the kernels take are those of the vLLM-Ascend [2, P] lengths, and
    each chunk's fields are its own chunk's."""
    rank = data.draw(st.integers(0, pcp - 1))
    plan = plan_pcp_split(np.array(new_lens, dtype=np.int64), pcp, rank)
    split = ascend(plan)
    chunks = np.array([-(-n // (2 * pcp)) for n in new_lens], dtype=np.int64)
    local, restored = 2 * int(chunks.sum()), 2 * pcp * int(chunks.sum())
    assert len(split.q_full_idx) == local
    for name in ("q_head_idx", "q_tail_idx", "q_full_idx"):
        idx = getattr(split, name).numpy()
        assert idx.dtype == np.int64 and ((0 <= idx) & (idx < local)).all(), name
    for name in ("kv_with_q_head_nomask_idx", "kv_with_q_head_mask_idx",
                 "kv_with_q_tail_nomask_idx", "kv_with_q_tail_mask_idx"):
        idx = getattr(split, name).numpy()
        assert idx.dtype == np.int64 and ((0 <= idx) & (idx < restored)).all(), name
    both = np.concatenate([split.q_head_idx.numpy(), split.q_tail_idx.numpy()])
    assert np.array_equal(split.q_full_idx.numpy(), np.argsort(both, kind="stable"))

    def cum(lengths) -> list[int]:
        return [0] + np.cumsum(np.asarray(lengths, dtype=np.int64)).tolist()

    assert lst(plan.chunk_cu_seqlens) == cum(split.attn_mask_seqlens[0]) == cum(chunks)
    assert lst(plan.chunk_cu_seqlens) == cum(split.attn_mask_seqlens[1])
    assert lst(plan.chunk_keys_before[0]) == lst(split.head_attn_nomask_seqlens[1])
    assert lst(plan.chunk_keys_before[1]) == lst(split.tail_attn_nomask_seqlens[1])
    assert plan.chunk_q_idx.shape == (2, int(chunks.sum()))
    for slot, chunk in enumerate((rank, 2 * pcp - 1 - rank)):
        assert lst(plan.chunk_keys_before[slot]) == (chunk * chunks).tolist()
        assert len(getattr(split, ("kv_with_q_head_nomask_idx", "kv_with_q_tail_nomask_idx")[
            slot])) == chunk * int(chunks.sum())
    assert torch.equal(plan.chunk_q_idx[0], split.q_head_idx)
    assert torch.equal(plan.chunk_q_idx[1], split.q_tail_idx)
    # The diagonals' one call: its sequences are the head and tail chunks of each prefill in
    # turn, exactly the rows q_head_idx / q_tail_idx pick.
    local_cu = plan.local_chunk_cu_seqlens.numpy()
    assert local_cu[0] == 0 and local_cu[-1] == local and len(local_cu) == 2 * len(new_lens) + 1
    pieces = [np.arange(a, b) for a, b in zip(local_cu[:-1], local_cu[1:])]
    assert np.array_equal(np.concatenate([np.zeros(0, np.int64)] + pieces[0::2]),
                          split.q_head_idx.numpy())
    assert np.array_equal(np.concatenate([np.zeros(0, np.int64)] + pieces[1::2]),
                          split.q_tail_idx.numpy())
    # Bookkeeping rows agree with the index tensors.
    restored_req, restored_pos = plan.pcp_partition.restored_rows(plan.chunk_lens)
    order = restored_req * (1 << 32) + restored_pos
    assert (np.diff(order) > 0).all()
    gathered_req = np.concatenate([plan.pcp_partition.local_rows(plan.chunk_lens, r)[0]
                                   for r in range(pcp)])
    assert np.array_equal(gathered_req[plan.pcp_allgather_restore_idx.numpy()], restored_req)


@settings(**SETTINGS)
@given(reqs=batches(), pcp=st.sampled_from((1,) + PCP_SIZES))
def test_prefill_real_kv_idx_picks_the_real_step_rows(reqs, pcp):
    """Step rows = decode rows, then each prefill's (padded) tokens in order; the encoder-only
    index picks exactly the prefills' real tokens, in order."""
    _, metas = build_all(reqs, CPConfig(pcp_size=pcp))
    decodes = expected_decode_tokens(reqs)
    step_rows = decodes + (expected_restored(reqs, pcp) if pcp > 1 else
                           [t for off, r in zip(token_offsets(reqs), reqs) if not r.is_decode
                            for t in range(off, off + r.new)])
    for meta in metas.values():
        idx = lst(meta.prefill_real_kv_idx)
        assert [step_rows[i] for i in idx] == [t for t in step_rows[len(decodes):] if t != PAD]
        assert lst(meta.prefill_real_cu_seqlens)[-1] == len(idx)
        assert len(meta.step_slot_mapping) == len(step_rows)


# --------------------------------------------------------------------------------------------
# The window-aware exchange (sliding-window layers): a simulated exchange of token ids
# --------------------------------------------------------------------------------------------
def expected_window_keys(reqs: list[Req], pcp: int, rank: int, window: int) -> list[list[int]]:
    """Per local chunk (prefill-major, head then tail): the step tokens (PAD for pads) at
    positions [max(0, k c - (window - 1)), k c + c), no halo for a chunk of pads only."""
    segments = []
    for off, r in zip(token_offsets(reqs), reqs):
        if r.is_decode:
            continue
        c = chunk_of(r, pcp)
        for chunk in (rank, 2 * pcp - 1 - rank):
            start = chunk * c
            lo = start if start >= r.new else max(0, start - (window - 1))
            segments.append([off + p if p < r.new else PAD for p in range(lo, start + c)])
    return segments


def expected_window_writes(reqs: list[Req], cfg: CPConfig, shard: int, window: int,
                           keep: str) -> list[int]:
    """Step tokens of the prefills a rank writing ``shard`` stores, in request order."""
    tokens = []
    for off, r in zip(token_offsets(reqs), reqs):
        if r.is_decode:
            continue
        first = 0 if keep == "all" else max(0, r.new - (window - 1))
        inter, world = cfg.cp_kv_interleave_size, cfg.kv_world
        tokens += [off + p for p in range(first, r.new)
                   if ((r.computed + p) // inter) % world == shard]
    return tokens


@settings(**SETTINGS)
@given(reqs=batches(), pcp=st.sampled_from(PCP_SIZES), window=st.integers(1, 400),
       kv_shard=st.sampled_from(["cp", "dcp"]), keep=st.sampled_from(["all", "window"]),
       interleave=st.sampled_from([1, 16]))
def test_window_exchange_brings_each_chunks_halo_and_the_shards_rows(reqs, pcp, window,
                                                                     kv_shard, keep, interleave):
    cfg = CPConfig(pcp_size=pcp, kv_shard=kv_shard, window_cache=keep,
                   cp_kv_interleave_size=interleave)
    step, metas = build_all(reqs, cfg, window=window)
    if all(r.is_decode for r in reqs):
        assert all(m.window_send_idx is None for m in metas.values())
        return
    local = {r: metas[(r, 0)].local_token_idx[metas[(r, 0)].num_decode_tokens:]
             for r in range(pcp)}
    sizes = {len(metas[(r, 0)].window_send_idx) for r in range(pcp)}
    assert len(sizes) == 1  # equal parts: one all-gather
    gathered = torch.cat([local[r][metas[(r, 0)].window_send_idx] for r in range(pcp)])
    for rank in range(pcp):
        meta = metas[(rank, 0)]
        source = torch.cat([local[rank], gathered])
        keys = source[meta.window_key_idx]
        cu = lst(meta.window_key_cu_seqlens)
        got = [lst(keys[a:b]) for a, b in zip(cu[:-1], cu[1:])]
        assert got == expected_window_keys(reqs, pcp, rank, window)
        # each chunk's queries are its own c rows, the last of its keys (bottom-right causal)
        q_cu = lst(meta.local_chunk_cu_seqlens)
        assert [s[len(s) - (b - a):] for s, a, b in zip(got, q_cu[:-1], q_cu[1:])] == \
            [lst(local[rank][a:b]) for a, b in zip(q_cu[:-1], q_cu[1:])]
        shard = cfg.kv_rank(rank, 0)
        written = source[meta.window_write_idx]
        assert lst(written) == expected_window_writes(reqs, cfg, shard, window, keep)
        # their slots are the step's: this shard's slot of each written token
        slots = meta.step_slot_mapping[meta.num_decode_tokens:]
        restored = torch.tensor(expected_restored(reqs, pcp))
        slot_of = {t: s for t, s in zip(lst(restored), lst(slots)) if t != PAD}
        assert lst(meta.window_write_slots) == [slot_of[t] for t in lst(written)]
        assert all(s >= 0 for s in lst(meta.window_write_slots))


@pytest.mark.parametrize("shape, window", [((1, 256), 512), ((8, 64), 128)])  # Gemma 3, GPT-OSS
@pytest.mark.parametrize("kv_shard", ["cp", "dcp"])
def test_window_exchange_bytes_at_32k(shape, window, kv_shard):
    """At 32k tokens and pcp=2 the window exchange of a layer whose cache keeps only the
    window sends at most 1/8 of the all-gather's rows (halos + the last window - 1 rows);
    keeping every row ("all") it sends the rows the other rank's shard stores, plus the halo
    rows that shard does not store (every other one)."""
    tokens = 32 * 1024
    rows = {}
    for keep in ("all", "window"):
        cfg = CPConfig(pcp_size=2, kv_shard=kv_shard, window_cache=keep, block_size=128)
        _, metas = build_all([Req(0, tokens)], cfg, window=window)
        rows[keep] = {len(m.window_send_idx) for m in metas.values()}.pop()
    all_gather = tokens // 2  # each rank's local rows
    halo = window - 1
    assert rows["window"] <= all_gather / 8
    assert rows["window"] <= 2 * halo  # rank 1's head halo and rank 0's tail's; the last rows
    expected_all = all_gather if kv_shard == "dcp" else all_gather // 2 + (halo + 1) // 2
    assert rows["all"] == expected_all
