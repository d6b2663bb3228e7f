"""Per-rank attention metadata built from a :class:`StepSpec` (pure: no process groups).

``MetadataBuilder.build`` runs named stages, each a short pure function of numpy int64 arrays;
the tensors the kernels take are made once, at the end (``torch.from_numpy``, no copy).

Row layouts (:class:`RowLayout`):
  * local rows: what this rank feeds the layer: the decode tokens (every PCP rank holds all of
    them), then for each prefill its tokens (single device) or its [head, tail] chunks (PCP,
    pads included).
  * step rows: every new token of the step, grouped per request: decode rows, then each
    prefill's padded tokens in order (under PCP, the restored all-gather). KV is written from
    these rows. Without PCP step rows == local rows.
  * context rows: the queries that attend cached context on this rank: the step rows when the
    cache is sharded over PCP ranks (queries of the whole PCP group), else the local rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.checks import validate_ranks, validate_step
from cp_attention.metadata.common import StepSpec, cumsum0, decode_mask, ranges_concat
from cp_attention.metadata.kv_layout import KVSharding
from cp_attention.metadata.pcp import HeadTail, PrefillPartition
from cp_attention.metadata.window import window_exchange_plan


@dataclass
class AttentionMetadata:
    """Everything one rank's attention needs for one step.

    Kernel inputs are int64 CPU tensors (``ctx_block_table`` keeps the step's block-table
    dtype); host bookkeeping (request lists) is int64 numpy. vLLM-Ascend's names (attn_state,
    ``batch_seq_mask``, ...) are a view: :mod:`cp_attention.metadata.vllm_ascend`.
    """

    decode_reqs: np.ndarray  # [Nd] batch indices of decodes (batch order)
    prefill_reqs: np.ndarray  # [Np] batch indices of prefills (batch order)
    num_decode_tokens: int
    num_local_rows: int  # local rows (README glossary): PCP pad rows included, graph padding not
    num_input_tokens: int  # rows of the layer's buffers (>= num_local_rows; graph padding)
    local_token_idx: torch.Tensor  # [num_input_tokens] global token index of each row, -1 = pad
    positions: torch.Tensor  # [num_input_tokens] RoPE position of each row (0 for pads)
    pad_rows: torch.Tensor | None  # [num_local_rows] bool, True on PCP pads; None: no pads
    decode_cu_seqlens: torch.Tensor  # [Nd + 1] over the decode rows
    prefill_cu_seqlens: torch.Tensor  # [Np + 1] over the local prefill rows
    prefill_real_cu_seqlens: torch.Tensor  # [Np + 1] over prefill_real_kv_idx
    step_slot_mapping: torch.Tensor  # [step rows] cache slot on this rank, -1 = not stored here
    has_context: bool  # some request has cached context (same on every rank)
    ctx_over_pcp: bool  # context rows are the step rows (queries gathered over PCP)
    ctx_cu_seqlens: torch.Tensor  # [R + 1] over context rows (decodes, then prefills)
    ctx_block_table: torch.Tensor  # [R, max_blocks] rows in context order
    ctx_seq_lens: torch.Tensor  # [R] cached tokens of each request held by this rank
    ctx_kv_start: torch.Tensor | None  # [context rows] local visible range (sliding window)
    ctx_kv_end: torch.Tensor | None
    sliding_window: int | None
    # PCP (pcp_size > 1): the split of the P prefills for this rank (m local chunks of c rows
    # each per prefill), made by ``pcp_partition.plan``; None without PCP
    pcp_partition: PrefillPartition | None = None  # the strategy (HeadTail)
    pcp_rank: int = 0
    chunk_cu_seqlens: torch.Tensor | None = None  # [P + 1] C: rows of one chunk (= diagonal)
    local_chunk_cu_seqlens: torch.Tensor | None = None  # [m P + 1] local rows of each chunk
    chunk_q_idx: torch.Tensor | None = None  # [m, sum c] local prefill rows of each chunk
    chunk_keys_before: torch.Tensor | None = None  # [m, P] restored keys before each chunk
    pcp_allgather_restore_idx: torch.Tensor | None = None  # [pcp m sum c] gathered -> restored
    pcp_allgather_scatter_idx: torch.Tensor | None = None  # inverse: restored -> gathered
    # PCP with a sliding window (:mod:`~cp_attention.metadata.window`): instead of the
    # all-gather, each rank receives its chunks' halos and the rows its shard writes; source
    # rows = local prefill rows, then the exchange's pcp parts of S rows
    window_send_idx: torch.Tensor | None = None  # [S] local prefill rows this rank sends
    window_key_idx: torch.Tensor | None = None  # [keys] source row of each local chunk's keys
    window_key_cu_seqlens: torch.Tensor | None = None  # [m P + 1] keys of each local chunk
    window_write_idx: torch.Tensor | None = None  # [writes] source rows written to the cache
    window_write_slots: torch.Tensor | None = None  # [writes] their slots on this shard
    # decode-only step (no prefill row, so no query is gathered over PCP): the layer writes
    # the step's K/V first, then each row attends this rank's shard alone in one paged call
    # (no self part, no merge; shards' partials combined as context ones). Block table and
    # query offsets are the ctx_ ones; lengths count this rank's shard after the write.
    single_pass: bool = False
    single_pass_seq_lens: torch.Tensor | None = None  # [R] tokens on this shard after write
    single_pass_kv_start: torch.Tensor | None = None  # [rows] first visible key (window)
    single_pass_kv_end: torch.Tensor | None = None  # [rows] local causal end (spec tokens)

    @property
    def pcp_size(self) -> int:
        return 1 if self.pcp_partition is None else self.pcp_partition.pcp_size

    @property
    def chunk_lens(self) -> np.ndarray:
        """[P] chunk size c of each prefill (PCP)."""
        return np.diff(self.chunk_cu_seqlens.numpy())

    @property
    def padded_lens(self) -> np.ndarray:
        """[P] restored (padded) rows of each prefill (PCP)."""
        return self.pcp_partition.num_chunks * self.chunk_lens

    @property
    def num_local_prefill_rows(self) -> int:
        return self.num_local_rows - self.num_decode_tokens

    @cached_property
    def prefill_real_kv_idx(self) -> torch.Tensor:
        """[prefill tokens] step rows of the prefills' real tokens (encoder-only attention,
        which alone reads it: made on first use, once per step)."""
        new_lens = np.diff(self.prefill_real_cu_seqlens.numpy())
        rows = new_lens if self.pcp_partition is None else self.padded_lens
        first_row = self.num_decode_tokens + cumsum0(rows)[:-1]
        return torch.from_numpy(ranges_concat(first_row, new_lens))

    @property
    def num_reqs(self) -> int:
        return len(self.decode_reqs) + len(self.prefill_reqs)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_reqs)


_t = torch.from_numpy  # an int64 (or bool) array as a CPU tensor sharing its memory


# -- row layouts --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowLayout:
    """Rows as segments ([S] int64 each): segment k is ``length[k]`` rows of request ``req[k]``
    (batch index) at offsets ``start[k] ..`` of its padded new tokens; its first ``real[k]``
    rows are real tokens, the rest pads (pads only trail a request)."""

    req: np.ndarray
    start: np.ndarray
    length: np.ndarray
    real: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.length.sum())

    def __add__(self, other: RowLayout) -> RowLayout:
        return RowLayout(np.concatenate([self.req, other.req]),
                         np.concatenate([self.start, other.start]),
                         np.concatenate([self.length, other.length]),
                         np.concatenate([self.real, other.real]))

    def ranges(self, first: np.ndarray) -> np.ndarray:
        """[rows] ``first[k] + j`` for row j of segment k (first: [S])."""
        return ranges_concat(first, self.length)

    def pad_rows(self) -> np.ndarray | None:
        """[rows] bool, True on pads; None when every row is real."""
        if (self.real == self.length).all():
            return None
        return self.ranges(-self.real) >= 0


def whole_requests(reqs: np.ndarray, new_lens: np.ndarray, rows: np.ndarray) -> RowLayout:
    """One segment per request: ``rows`` ([n]) rows of which the first ``new_lens`` are real."""
    return RowLayout(reqs, np.zeros(len(reqs), dtype=np.int64), rows, new_lens)


def pcp_local_rows(prefills: np.ndarray, new_lens: np.ndarray, partition: PrefillPartition,
                   chunk_lens: np.ndarray, rank: int) -> RowLayout:
    """Each prefill's chunks of ``rank`` in local order (m segments of c rows per prefill)."""
    start, length = partition.local_segments(chunk_lens, rank)
    m = partition.chunks_per_rank
    real = np.minimum(np.maximum(new_lens.repeat(m) - start, 0), length)
    return RowLayout(prefills.repeat(m), start, length, real)


# -- stages ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillPlan:
    """Where the prefills' rows are on this rank."""

    reqs: np.ndarray  # [Np] batch index of each prefill
    pcp_fields: dict[str, torch.Tensor]  # the PCP split (``PrefillPartition.plan``); {} without
    local: RowLayout  # local prefill rows
    step: RowLayout  # step prefill rows (== local without PCP)
    local_rows_per_req: np.ndarray  # [Np]


def plan_prefills(prefills: np.ndarray, new_lens: np.ndarray,
                  partition: PrefillPartition | None, pcp_rank: int) -> PrefillPlan:
    """The prefill rows (local and step) of a rank; new_lens: [Np] new tokens per prefill;
    partition: how prefills are cut over PCP ranks (None: pcp_size == 1)."""
    if partition is None:
        rows = whole_requests(prefills, new_lens, new_lens)
        return PrefillPlan(prefills, {}, rows, rows, new_lens)
    c = partition.chunk_lens(new_lens)
    return PrefillPlan(prefills, partition.plan(new_lens, pcp_rank),
                       pcp_local_rows(prefills, new_lens, partition, c, pcp_rank),
                       whole_requests(prefills, new_lens, partition.num_chunks * c),
                       partition.chunks_per_rank * c)


def token_rows(rows: RowLayout, step: StepSpec, num_input: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[num_input] (global token index, RoPE position) of each row; -1 / 0 on pads and on the
    ``num_input - rows.num_rows`` trailing graph-padding rows; and the [rows] pad mask (None
    when every row is real)."""
    tokens = rows.ranges(step.cu_new_tokens[rows.req] + rows.start)
    positions = tokens + (step.computed - step.cu_new_tokens[:-1])[rows.req].repeat(rows.length)
    pads = rows.pad_rows()
    if pads is not None:
        tokens[pads] = -1
        positions[pads] = 0
    extra = num_input - len(tokens)
    if extra:
        tokens = np.concatenate([tokens, np.full(extra, -1, dtype=np.int64)])
        positions = np.concatenate([positions, np.zeros(extra, dtype=np.int64)])
    return tokens, positions, pads


def step_slot_mapping(rows: RowLayout, cu_rows: np.ndarray, step: StepSpec,
                      block_table: np.ndarray, sharding: KVSharding, kv_rank: int) -> np.ndarray:
    """[step rows] cache slot of each step row on KV shard ``kv_rank``, -1 elsewhere.

    cu_rows: [S + 1] ``cumsum0(rows.length)`` (one segment per request for step rows)."""
    return sharding.segment_slots(rows.req, cu_rows[:-1], step.computed[rows.req] + rows.start,
                                  rows.real, int(cu_rows[-1]), block_table, kv_rank)


@dataclass(frozen=True)
class ContextPlan:
    """Queries of cached context on this rank, requests in context order (decodes, prefills)."""

    over_pcp: bool  # context rows are the step rows (queries gathered over PCP)
    rows: RowLayout  # the context rows
    order: np.ndarray  # [R] batch index of each request in context order
    cu_rows: np.ndarray  # [R + 1] context rows before each request
    seq_lens: np.ndarray  # [R] cached tokens of each request held by this rank


def plan_context(step: StepSpec, config: CPConfig, sharding: KVSharding, kv_rank: int,
                 order: np.ndarray, local: tuple[RowLayout, np.ndarray],
                 step_rows: tuple[RowLayout, np.ndarray], pcp: bool) -> ContextPlan:
    """Which rows query the cached context, and how much of it this rank holds.

    order: [R] batch index of each request in context order (decodes, then prefills);
    local / step_rows: (layout, cu rows per request [R + 1]) of the local and step rows;
    pcp: prefills are split over PCP ranks."""
    over_pcp = pcp and config.kv_shard == "cp"
    rows, cu_rows = step_rows if over_pcp else local
    return ContextPlan(over_pcp, rows, order, cu_rows,
                       sharding.local_count(step.computed[order], kv_rank))


def window_ranges(rows: RowLayout, step: StepSpec, window: int, sharding: KVSharding,
                  kv_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """[context rows] local key range [start, end) a query sees on this shard (sliding window).

    A query at position p sees global keys [max(0, p - window + 1), p]; of these the cache
    holds [.., context) (p >= context), stored here as local [local_count(lo), local_count(C)).
    """
    context = step.computed[rows.req]
    pos = rows.ranges(context + rows.start)
    context_of_row = np.repeat(context, rows.length)
    lo = np.minimum(np.maximum(pos - window + 1, 0), context_of_row)
    start = sharding.local_count(lo, kv_rank)
    end = np.repeat(sharding.local_count(context, kv_rank), rows.length)
    pads = rows.pad_rows()
    if pads is not None:
        start[pads] = 0
        end[pads] = 0
    return start, end


def single_pass(rows: RowLayout, step: StepSpec, window: int | None, sharding: KVSharding,
                kv_rank: int) -> dict[str, torch.Tensor | bool | None]:
    """The single-pass fields of a decode-only step on KV shard ``kv_rank`` (``rows``: one
    segment per request, batch order): a row at position p sees the keys
    [max(0, p - window + 1), p] of the written cache that this shard holds."""
    count = sharding.local_count
    context = step.computed[rows.req]
    plan = {"single_pass": True, "single_pass_seq_lens": _t(count(context + rows.length, kv_rank))}
    if window is None and (rows.length == 1).all():
        return plan  # each row sees its whole request
    pos = rows.ranges(context)
    plan["single_pass_kv_end"] = _t(count(pos + 1, kv_rank))
    if window is not None:
        plan["single_pass_kv_start"] = _t(count(np.maximum(pos - window + 1, 0), kv_rank))
    return plan


class MetadataBuilder:
    """Builds :class:`AttentionMetadata` for one rank (any pcp_size / dcp_size)."""

    def __init__(self, config: CPConfig | None = None, ranks: CPRanks | None = None,
                 sliding_window: int | None = None, num_blocks: int | None = None,
                 debug: bool = False) -> None:
        """debug: also run the O(R x max_blocks) step checks of
        :func:`cp_attention.metadata.checks.validate_step` (duplicate blocks, blocks written by two
        requests) on every build."""
        self.config = config or CPConfig()
        self.ranks = ranks or CPRanks()
        self.debug = debug
        validate_ranks(self.config, self.ranks)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.kv_rank = self.config.kv_rank(self.ranks.pcp_rank, self.ranks.dcp_rank)
        self.sharding = KVSharding.of(self.config)
        self.partition = HeadTail(self.config.pcp_size) if self.config.pcp_size > 1 else None
        # [pcp] the KV shard each PCP rank of this rank's group writes
        self.pcp_kv_ranks = np.array([self.config.kv_rank(p, self.ranks.dcp_rank)
                                      for p in range(self.config.pcp_size)])

    def build(self, step: StepSpec, num_input_tokens: int | None = None) -> AttentionMetadata:
        """Plan one step for this rank; ``num_input_tokens`` pads the rows (graph capture)."""
        cfg = self.config
        block_table = step.block_table.cpu()
        table = block_table.numpy()
        self._check_block_table(step.seq_lens, table)
        if self.debug:
            validate_step(step, cfg, self.num_blocks)

        is_decode = decode_mask(step, cfg.decode_threshold)
        decodes, prefills = is_decode.nonzero()[0], (~is_decode).nonzero()[0]
        dec_lens, new_lens = step.scheduled[decodes], step.scheduled[prefills]
        dec_rows = whole_requests(decodes, dec_lens, dec_lens)
        pre = plan_prefills(prefills, new_lens, self.partition, self.ranks.pcp_rank)
        local_rows = dec_rows + pre.local
        # [R + 1] rows before each request (decodes, then prefills), local and step rows
        cu_local = cumsum0(np.concatenate([dec_lens, pre.local_rows_per_req]))
        if self.partition is None:  # step rows are the local rows
            step_rows, cu_step = local_rows, cu_local
        else:
            step_rows = dec_rows + pre.step
            cu_step = cumsum0(step_rows.length)
        num_dec = len(decodes)
        num_dec_rows, num_local = int(cu_local[num_dec]), int(cu_local[-1])
        num_input = num_local if num_input_tokens is None else num_input_tokens
        if num_input < num_local:
            raise ValueError(f"num_input_tokens ({num_input}) is smaller than the {num_local} "
                             f"rows this rank computes")
        tokens, positions, pads = token_rows(local_rows, step, num_input)
        slots = step_slot_mapping(step_rows, cu_step, step, table, self.sharding, self.kv_rank)
        order = np.concatenate([decodes, prefills])
        ctx = plan_context(step, cfg, self.sharding, self.kv_rank, order,
                           (local_rows, cu_local), (step_rows, cu_step), self.partition is not None)
        kv_start = kv_end = None
        if self.sliding_window is not None:
            kv_start, kv_end = map(_t, window_ranges(ctx.rows, step, self.sliding_window,
                                                     self.sharding, self.kv_rank))
        decodes_first = num_dec == 0 or decodes[-1] == num_dec - 1
        has_context = bool(step.computed.any())
        # decode-only: no prefill rows, so no query is gathered over PCP even when the cache is
        # sharded over PCP ranks (every rank then attends its shard; partials merged over PCP)
        one_pass = (single_pass(dec_rows, step, self.sliding_window, self.sharding, self.kv_rank)
                    if num_dec == step.num_reqs else {})
        exchange = {}
        if self.sliding_window is not None and self.partition is not None and len(prefills):
            exchange = window_exchange_plan(
                self.partition, self.partition.chunk_lens(new_lens), new_lens,
                step.computed[prefills], self.sliding_window, self.sharding, self.pcp_kv_ranks,
                self.ranks.pcp_rank, slots[num_dec_rows:], cfg.window_cache)

        return AttentionMetadata(
            decode_reqs=decodes,
            prefill_reqs=prefills,
            num_decode_tokens=num_dec_rows,
            num_local_rows=num_local,
            num_input_tokens=num_input,
            local_token_idx=_t(tokens),
            positions=_t(positions),
            pad_rows=None if pads is None else _t(pads),
            decode_cu_seqlens=_t(cu_local[:num_dec + 1]),
            prefill_cu_seqlens=_t(cu_local[num_dec:] - num_dec_rows),
            prefill_real_cu_seqlens=_t(cumsum0(new_lens)),
            step_slot_mapping=_t(slots),
            has_context=has_context,
            ctx_over_pcp=ctx.over_pcp,
            ctx_cu_seqlens=_t(ctx.cu_rows),
            ctx_block_table=(block_table if decodes_first
                             else block_table.index_select(0, _t(ctx.order))),
            ctx_seq_lens=_t(ctx.seq_lens),
            ctx_kv_start=kv_start,
            ctx_kv_end=kv_end,
            sliding_window=self.sliding_window,
            pcp_partition=self.partition,
            pcp_rank=self.ranks.pcp_rank,
            **pre.pcp_fields,
            **one_pass,
            **exchange,
        )

    def _check_block_table(self, seq_lens: np.ndarray, block_table: np.ndarray) -> None:
        """Every request has enough blocks, and the blocks it uses are valid ids."""
        cfg = self.config
        have = block_table.shape[1]
        if int(seq_lens.max()) > have * cfg.block_size * cfg.kv_world:  # the longest overflows
            needed = self.sharding.blocks_needed(seq_lens)
            r = int((needed > have).argmax())
            raise ValueError(f"block_table has {have} blocks per request but request {r} needs "
                             f"{int(needed[r])} for {int(seq_lens[r])} tokens "
                             f"(block_size {cfg.block_size} x {cfg.kv_world} KV shards)")
        if not block_table.size or (block_table.min() >= 0 and (
                self.num_blocks is None or block_table.max() < self.num_blocks)):
            return  # the common case, checked without building the mask below
        needed = self.sharding.blocks_needed(seq_lens)
        used = block_table[np.arange(have)[None, :] < needed[:, None]]
        if (used < 0).any():
            raise ValueError("block_table has a negative block id inside a request's blocks")
        if self.num_blocks is not None and (used >= self.num_blocks).any():
            raise ValueError(f"block_table names block {int(used.max())} but the cache has "
                             f"num_blocks={self.num_blocks}")

