"""Per-rank attention metadata built from a :class:`StepSpec` (pure: no process groups).

Row layouts used below:
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

import numpy as np
import torch

from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.checks import validate_ranks, validate_step
from cp_attention.metadata.common import (AttentionState, StepSpec, classify_state, cumsum0,
                                          decode_mask, ranges_concat)
from cp_attention.metadata.kv_layout import blocks_needed, local_count, slot_mapping
from cp_attention.metadata.pcp import PCPSplit, plan_pcp_split


def _t(array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


@dataclass
class AttentionMetadata:
    """Everything one rank's attention needs for one step. Tensors are int64 on CPU."""

    state: AttentionState
    num_reqs: int
    decode_reqs: np.ndarray  # [Nd] batch indices of decodes (batch order)
    prefill_reqs: np.ndarray  # [Np] batch indices of prefills (batch order)
    num_decode_tokens: int
    num_actual_tokens: int  # local rows with meaning (pads of PCP chunks included)
    num_input_tokens: int  # rows of the layer's buffers (>= num_actual_tokens; graph padding)
    local_token_idx: torch.Tensor  # [num_input_tokens] global token index of each row, -1 = pad
    positions: torch.Tensor  # [num_input_tokens] RoPE position of each row (0 for pads)
    decode_cu_seqlens: torch.Tensor  # [Nd + 1] over the decode rows
    prefill_cu_seqlens: torch.Tensor  # [Np + 1] over the local prefill rows
    pcp: PCPSplit | None  # head/tail split when pcp_size > 1
    prefill_real_kv_idx: torch.Tensor  # step prefill rows that are real tokens (encoder-only)
    prefill_real_cu_seqlens: torch.Tensor  # [Np + 1] over prefill_real_kv_idx
    step_slot_mapping: torch.Tensor  # [step rows] cache slot on this rank, -1 = not stored here
    has_context: bool  # some request has cached context (same on every rank)
    ctx_over_pcp: bool  # context rows are the step rows (queries gathered over PCP)
    ctx_cu_seqlens: torch.Tensor  # [R + 1] over context rows (decodes, then prefills)
    ctx_block_table: torch.Tensor  # [R, max_blocks] rows in context order
    ctx_seq_lens: torch.Tensor  # [R] cached tokens of each request held by this rank
    ctx_kv_start: torch.Tensor | None  # [context rows] local visible range (sliding window)
    ctx_kv_end: torch.Tensor | None
    batch_seq_mask: torch.Tensor  # [R] bool, True where this rank holds no context of the request
    num_computed_tokens_of_pcp_dcp: np.ndarray  # [R, pcp, dcp] local context lengths, batch order
    sliding_window: int | None

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_reqs)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_reqs)


class MetadataBuilder:
    """Builds :class:`AttentionMetadata` for one rank of a single-device deployment."""

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
        self._check_sizes()

    def _check_sizes(self) -> None:
        if self.config.uses_cp:
            raise ValueError(f"MetadataBuilder is single-device; pcp_size={self.config.pcp_size}"
                             f", dcp_size={self.config.dcp_size} need CPMetadataBuilder")

    # -- hooks the CP builder overrides -------------------------------------------------
    def _split_prefills(self, new_lens: np.ndarray) -> PCPSplit | None:
        return None

    @property
    def kv_shard(self) -> int:
        return self.config.kv_rank(self.ranks.pcp_rank, self.ranks.dcp_rank)

    # -- building ----------------------------------------------------------------------
    def build_for_graph_capture(self, num_tokens: int, max_blocks: int = 1) -> AttentionMetadata:
        """Metadata of a dummy decode-only batch of ``num_tokens`` requests (graph capture)."""
        step = StepSpec((1,) * num_tokens, (1,) * num_tokens,
                        torch.zeros(num_tokens, max_blocks, dtype=torch.int32))
        return self.build(step)

    def build(self, step: StepSpec, num_input_tokens: int | None = None) -> AttentionMetadata:
        """Plan one step for this rank; ``num_input_tokens`` pads the rows (graph capture)."""
        cfg = self.config
        computed = np.asarray(step.num_computed_tokens, dtype=np.int64)
        scheduled = np.asarray(step.num_scheduled_tokens, dtype=np.int64)
        cu_new = step.cu_new_tokens
        block_table = step.block_table.cpu().numpy()
        self._check_block_table(computed + scheduled, block_table)
        if self.debug:
            validate_step(step, cfg, self.num_blocks)

        is_decode = decode_mask(step, cfg.decode_threshold)
        decodes, prefills = np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]

        # Decode rows: identical on every PCP rank.
        dec_lens = scheduled[decodes]
        dec_req = np.repeat(decodes, dec_lens)
        dec_off = ranges_concat(np.zeros(len(decodes), dtype=np.int64), dec_lens)

        # Prefill rows: local and step (restored) layouts.
        pre_lens = scheduled[prefills]
        split = self._split_prefills(pre_lens)
        if split is None:
            loc_req = np.repeat(prefills, pre_lens)
            loc_off = ranges_concat(np.zeros(len(prefills), dtype=np.int64), pre_lens)
            step_req, step_off = loc_req, loc_off
            prefill_rows_per_req = pre_lens
            step_rows_per_req = pre_lens
        else:
            loc_req, loc_off = prefills[split.local_req], split.local_padded_pos
            step_req, step_off = prefills[split.restored_req], split.restored_padded_pos
            prefill_rows_per_req = 2 * split.chunk_lens
            step_rows_per_req = 2 * cfg.pcp_size * split.chunk_lens
        loc_real = loc_off < scheduled[loc_req]
        step_real = step_off < scheduled[step_req]

        num_actual = len(dec_req) + len(loc_req)
        num_input = num_actual if num_input_tokens is None else num_input_tokens
        if num_input < num_actual:
            raise ValueError(f"num_input_tokens ({num_input}) is smaller than the {num_actual} "
                             f"rows this rank computes")
        pad = np.full(num_input - num_actual, -1, dtype=np.int64)
        local_token_idx = np.concatenate([cu_new[dec_req] + dec_off,
                                          np.where(loc_real, cu_new[loc_req] + loc_off, -1), pad])
        positions = np.concatenate([computed[dec_req] + dec_off,
                                    np.where(loc_real, computed[loc_req] + loc_off, 0), 0 * pad])

        # KV written from step rows, tokens owned by this shard only.
        all_step_req = np.concatenate([dec_req, np.where(step_real, step_req, -1)])
        all_step_pos = np.concatenate([computed[dec_req] + dec_off, computed[step_req] + step_off])
        step_slots = slot_mapping(all_step_req, all_step_pos, block_table, cfg.block_size,
                                  cfg.kv_world, self.kv_shard, cfg.cp_kv_interleave_size)
        if self.num_blocks is not None:
            too_far = step_slots >= self.num_blocks * cfg.block_size
            if too_far.any():
                raise ValueError(f"slot_mapping: slot {int(step_slots[too_far][0])} is outside "
                                 f"the cache of {self.num_blocks} blocks")
        step_prefill_start = len(dec_req)
        real_idx = step_prefill_start + np.nonzero(step_real)[0]

        # Context: queries in request order (decodes, then prefills).
        order = np.concatenate([decodes, prefills])
        in_batch_order = bool((order == np.arange(len(order))).all())
        ctx_over_pcp = split is not None and cfg.kv_shard == "cp"
        rows_per_req = np.concatenate([dec_lens, step_rows_per_req if ctx_over_pcp
                                       else prefill_rows_per_req])
        ctx_lens = local_count(computed[order], self.kv_shard, cfg.kv_world,
                               cfg.cp_kv_interleave_size)
        kv_start = kv_end = None
        if self.sliding_window is not None:
            row_req = np.concatenate([dec_req, step_req if ctx_over_pcp else loc_req])
            row_off = np.concatenate([dec_off, step_off if ctx_over_pcp else loc_off])
            row_real = np.concatenate([np.ones(len(dec_req), bool),
                                       step_real if ctx_over_pcp else loc_real])
            pos = computed[row_req] + row_off
            context = computed[row_req]
            lo = np.clip(pos - self.sliding_window + 1, 0, context)
            hi = np.minimum(pos + 1, context)
            shard, world, inter = self.kv_shard, cfg.kv_world, cfg.cp_kv_interleave_size
            kv_start = _t(np.where(row_real, local_count(lo, shard, world, inter), 0))
            kv_end = _t(np.where(row_real, local_count(hi, shard, world, inter), 0))

        pcp_ranks = np.arange(cfg.pcp_size)[:, None]
        dcp_ranks = np.arange(cfg.dcp_size)[None, :]
        shards = pcp_ranks * cfg.dcp_size + dcp_ranks if cfg.kv_shard == "cp" else 0 * pcp_ranks + dcp_ranks
        per_rank = local_count(computed[:, None, None], shards[None], cfg.kv_world,
                               cfg.cp_kv_interleave_size)

        return AttentionMetadata(
            state=classify_state(step, cfg.decode_threshold),
            num_reqs=step.num_reqs,
            decode_reqs=decodes,
            prefill_reqs=prefills,
            num_decode_tokens=len(dec_req),
            num_actual_tokens=num_actual,
            num_input_tokens=num_input,
            local_token_idx=_t(local_token_idx),
            positions=_t(positions),
            decode_cu_seqlens=_t(cumsum0(dec_lens)),
            prefill_cu_seqlens=_t(cumsum0(prefill_rows_per_req)),
            pcp=split,
            prefill_real_kv_idx=_t(real_idx),
            prefill_real_cu_seqlens=_t(cumsum0(pre_lens)),
            step_slot_mapping=_t(step_slots),
            has_context=bool((computed > 0).any()),
            ctx_over_pcp=ctx_over_pcp,
            ctx_cu_seqlens=_t(cumsum0(rows_per_req)),
            ctx_block_table=(step.block_table.cpu() if in_batch_order
                             else _t(block_table[order], step.block_table.dtype)),
            ctx_seq_lens=_t(ctx_lens),
            ctx_kv_start=kv_start,
            ctx_kv_end=kv_end,
            batch_seq_mask=_t(ctx_lens == 0, torch.bool),
            num_computed_tokens_of_pcp_dcp=per_rank,
            sliding_window=self.sliding_window,
        )

    def _check_block_table(self, seq_lens: np.ndarray, block_table: np.ndarray) -> None:
        """Every request has enough blocks, and the blocks it uses are valid ids."""
        cfg = self.config
        needed = blocks_needed(seq_lens, cfg.block_size, cfg.kv_world)
        have = block_table.shape[1]
        short = np.nonzero(needed > have)[0]
        if len(short):
            r = int(short[0])
            raise ValueError(f"block_table has {have} blocks per request but request {r} needs "
                             f"{int(needed[r])} for {int(seq_lens[r])} tokens "
                             f"(block_size {cfg.block_size} x {cfg.kv_world} KV shards)")
        low, high = (int(block_table.min()), int(block_table.max())) if block_table.size else (0, 0)
        if low >= 0 and (self.num_blocks is None or high < self.num_blocks):
            return  # the common case, checked without building the mask below
        used = block_table[np.arange(have)[None, :] < needed[:, None]]
        if (used < 0).any():
            raise ValueError("block_table has a negative block id inside a request's blocks")
        if self.num_blocks is not None and (used >= self.num_blocks).any():
            raise ValueError(f"block_table names block {int(used.max())} but the cache has "
                             f"num_blocks={self.num_blocks}")


class CPMetadataBuilder(MetadataBuilder):
    """Metadata builder when pcp_size > 1 or dcp_size > 1."""

    def _check_sizes(self) -> None:
        cfg = self.config
        for name, rank, size in (("pcp_rank", self.ranks.pcp_rank, cfg.pcp_size),
                                 ("tp_rank", self.ranks.tp_rank, cfg.tp_size),
                                 ("dcp_rank", self.ranks.dcp_rank, cfg.dcp_size)):
            if not 0 <= rank < size:
                raise ValueError(f"{name} ({rank}) must be in [0, {size})")

    def _split_prefills(self, new_lens: np.ndarray) -> PCPSplit | None:
        if self.config.pcp_size == 1:
            return None
        return plan_pcp_split(new_lens, self.config.pcp_size, self.ranks.pcp_rank)
