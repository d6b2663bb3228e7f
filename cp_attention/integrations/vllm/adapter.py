"""Translation between vLLM's per-step inputs and cp_attention's (pure; no vLLM import).

vLLM numbers a step's new tokens in its batch order (``query_start_loc``); our metadata
numbers them the same way (``StepSpec`` global token index), so ``local_token_idx`` of our
metadata is directly the vLLM token index of each of our rows. Our rows put decodes first,
then prefills; vLLM's reorder puts ``query_len <= reorder_batch_threshold`` first, which
also includes prompts of one token without context (a prefill for us), so the two orders
may differ and rows are gathered / scattered with ``local_token_idx``.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from cp_attention.config import CPConfig
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.metadata.common import StepSpec


class SlotMappingMismatch(RuntimeError):
    """vLLM's slot mapping for a step differs from the one cp_attention computed."""


class UnsupportedLayout(NotImplementedError):
    """A vLLM parallel layout cp_attention does not map (yet)."""


def engine_cp_config(vllm_config, kv_replicated: bool = False) -> CPConfig:
    """The engine's CPConfig (``vllm_config``: vLLM ``VllmConfig``-like), the one object the
    config hook checks and every builder and impl of the engine holds: block size
    ``cache_config.block_size``, decode_threshold 1 + speculative tokens (the builder's
    ``reorder_batch_threshold``), window_cache "all" with prefix caching on (a hit may read any
    block of a window layer), else "window" (docs/pcp.md section 9). Cached by its inputs,
    which a worker may still change before it builds layers (``update_block_size_for_backend``:
    a hybrid model's block size).

    ``kv_replicated``: the CPConfig of a KV cache group every DCP rank keeps whole
    (:func:`window_kv_replicated`): the layout of vLLM's dcp = 1 with the same pcp and tp."""
    spec = vllm_config.speculative_config
    threshold = 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)
    cache = vllm_config.cache_config
    return cp_config_from_vllm(vllm_config.parallel_config, cache.block_size, threshold,
                               "all" if cache.enable_prefix_caching else "window", kv_replicated)


def window_kv_replicated(vllm_config) -> bool:
    """True if this engine keeps its sliding-window layers' KV whole on every DCP rank.

    That is the case under PCP x DCP (vLLM pcp = dcp = P > 1) with the hybrid KV cache manager
    on: vLLM's ``SlidingWindowSpec`` cannot be DCP-sharded (its pool sizing and its prefix-cache
    lookup assert dcp = 1, ``vllm/v1/kv_cache_interface.py:889``,
    ``vllm/v1/core/single_type_kv_cache_manager.py:971``), but a group marked
    ``dcp_sharded=False`` is accepted (``vllm/v1/core/kv_cache_coordinator.py:667-679``) and
    holds only the window, about ``window + batch budget`` tokens per request, on each rank.
    With the hybrid manager off vLLM treats window layers as full attention (every token kept),
    so they stay sharded like the global layers and the window is applied in global
    positions. Why replicate rather than shard: docs/vllm.md "DCP for sliding-window layers".
    """
    pc = vllm_config.parallel_config
    pcp, dcp = pc.prefill_context_parallel_size, pc.decode_context_parallel_size
    return (pcp > 1 and dcp == pcp
            and not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)


def cp_config_from_vllm(parallel_config, block_size: int, decode_threshold: int = 1,
                        window_cache: str = "all", kv_replicated: bool = False) -> CPConfig:
    """CPConfig of a vLLM deployment (``parallel_config``: vLLM ``ParallelConfig``-like), one
    object per distinct sizes.

    vLLM's worlds are ``rank = pcp_rank * tp + tp_rank`` like ours. Its DCP group is the TP
    group's consecutive ranks when pcp = 1, and spans the PCP ranks first when pcp > 1
    (``vllm/distributed/parallel_state.py:2222``); with pcp > 1 dcp must be 1, pcp or tp*pcp
    (``vllm/config/parallel.py:590-603``). The KV cache is sharded over vLLM's DCP group only
    (the scheduler counts blocks with ``dcp_world_size``, ``pcp_world_size=1``), so vLLM's
    DCP group is our KV group and its DCP rank our ``kv_rank`` (``CPConfig``); our
    ``dcp_size`` counts the TP ranks that split a KV head's query heads:

    ======================  ===============================================================
    vLLM (pcp, dcp)         ours
    ======================  ===============================================================
    (1, D)                  pcp=1, dcp=D, kv_shard="dcp"
    (P, 1)                  pcp=P, dcp=1, kv_shard="dcp": every PCP rank keeps the whole KV
    (P, P)                  pcp=P, dcp=1, kv_shard="cp": the KV group is the PCP group
    (P, P*T), T > 1         refused (:class:`UnsupportedLayout`); vLLM's GQA rules
                            (``dcp <= tp // kv_heads``) reject it for GQA models anyway
    ======================  ===============================================================

    ``kv_replicated``: a KV cache group vLLM does not shard over its DCP group
    (``KVCacheSpec.dcp_sharded`` False): the mapping of (pcp, 1).
    """
    pc = parallel_config
    dcp = 1 if kv_replicated else pc.decode_context_parallel_size
    return _config_of_sizes(*map(int, (pc.prefill_context_parallel_size,
                                       dcp, pc.tensor_parallel_size,
                                       pc.cp_kv_cache_interleave_size, block_size,
                                       decode_threshold)), window_cache)


@functools.cache
def _config_of_sizes(pcp: int, dcp: int, tp: int, interleave: int, block_size: int,
                     decode_threshold: int, window_cache: str) -> CPConfig:
    """The mapping of :func:`cp_config_from_vllm` (cached: one object per distinct sizes)."""
    if pcp == 1:
        ours_dcp, kv_shard = dcp, "dcp"
    elif dcp == 1:
        ours_dcp, kv_shard = 1, "dcp"
    elif dcp == pcp:
        ours_dcp, kv_shard = 1, "cp"
    else:
        raise UnsupportedLayout(
            f"--decode-context-parallel-size {dcp} with --prefill-context-parallel-size {pcp} "
            f"and --tensor-parallel-size {tp}: cp_attention maps dcp = 1 or dcp = pcp only")
    return CPConfig(pcp_size=pcp, dcp_size=ours_dcp, tp_size=tp, block_size=block_size,
                    cp_kv_interleave_size=interleave, kv_shard=kv_shard,
                    decode_threshold=decode_threshold, window_cache=window_cache)


def expected_vllm_dcp_rank(config: CPConfig, pcp_rank: int, tp_rank: int) -> int:
    """vLLM's DCP rank of a worker under :func:`cp_config_from_vllm`'s mapping: its rank in
    the KV group."""
    return config.kv_rank(pcp_rank, tp_rank % config.dcp_size)


def step_from_vllm(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor,
                   block_table: torch.Tensor, num_reqs: int) -> StepSpec:
    """StepSpec from vLLM's ``CommonAttentionMetadata`` fields (CPU tensors); its
    ``num_new_tokens`` is vLLM's real tokens (``query_start_loc[num_reqs]``).

    query_start_loc_cpu: [>= R + 1]; seq_lens_cpu: [>= R] total length incl. this step;
    block_table: [>= R, max_blocks] (virtual blocks under DCP). Requests with no new tokens
    (batch padding) are dropped; they hold no token rows so token numbering is unchanged.
    """
    qsl = query_start_loc_cpu[:num_reqs + 1].numpy().astype(np.int64)
    new = np.diff(qsl)
    computed = seq_lens_cpu[:num_reqs].numpy() - new  # the only conversion: one numpy view
    if (computed < 0).any():
        r = int(np.argmax(computed < 0))
        raise ValueError(f"vLLM request {r}: seq_len {int(computed[r] + new[r])} < query_len "
                         f"{int(new[r])}")
    table = block_table[:num_reqs]
    if not (new > 0).all():  # batch padding: requests with no new tokens are dropped
        keep = np.flatnonzero(new > 0)
        computed, new, table = computed[keep], new[keep], table[torch.from_numpy(keep)]
    return StepSpec(computed, new, table)


def row_order(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor | None:
    """vLLM token index of each of our rows ([num_local_rows] int64), or None if identical.

    Only for layouts without padding rows (pcp_size == 1).
    """
    idx = meta.local_token_idx[:meta.num_local_rows]
    if idx.numel() == num_tokens and torch.equal(idx, torch.arange(num_tokens, dtype=idx.dtype)):
        return None
    if meta.num_local_rows != num_tokens or bool((idx < 0).any()):
        raise ValueError(f"rows ({meta.num_local_rows}, pads included) do not match vLLM's "
                         f"{num_tokens} tokens one to one (with pcp_size > 1 the PCP model "
                         "runner selects rows with local_input_rows, not row_order)")
    return idx


def local_input_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The vLLM token each row of this rank reads, and the rows' positions (PCP model input).

    Returns (token_idx [num_local_rows] int64 with pads pointing at token 0, positions
    [num_local_rows] int64 with 0 for pads). The attention impl masks pad rows.
    """
    rows = meta.local_token_idx[:meta.num_local_rows]
    return rows.clamp(min=0), meta.positions[:meta.num_local_rows]


def rows_holding(meta: AttentionMetadata, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's row of each vLLM token in ``tokens`` ([n] int64), -1 where it has none."""
    rows = meta.local_token_idx[:meta.num_local_rows]
    tokens = tokens.to(torch.int64)
    size = 1 + max(int(rows.max()) if rows.numel() else -1,
                   int(tokens.max()) if tokens.numel() else -1)
    where = torch.full((max(size, 1),), -1, dtype=torch.int64)
    real = torch.nonzero(rows >= 0).flatten()
    where[rows[real]] = real
    return where[tokens]


def pack_held_rows(hidden: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """[n, H + 1]: the hidden row for each wanted token this rank holds (``held`` >= 0), else
    zeros; the last column is 1 where held, 0 elsewhere."""
    flag = (held >= 0)
    rows = hidden[held.clamp(min=0)] * flag.unsqueeze(-1).to(hidden.dtype)
    return torch.cat([rows, flag.unsqueeze(-1).to(hidden.dtype)], dim=-1)


def pick_held_rows(gathered: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """gathered [P, n, H + 1] (one :func:`pack_held_rows` per PCP rank) -> [n, H]: each row from
    the first rank that holds it. Raises if some wanted token is held by no rank."""
    held = gathered[..., -1] > 0  # [P, n]
    missing = ~held.any(dim=0)
    if bool(missing.any()):
        bad = int(torch.nonzero(missing)[0, 0])
        raise RuntimeError(f"hidden-state restore: token {int(tokens[bad])} is held by no PCP "
                           "rank (row plan and vLLM batch disagree)")
    first = held.to(torch.int8).argmax(dim=0)  # [n]
    return gathered[first, torch.arange(gathered.shape[1]), :-1]


def step_row_tokens(meta: AttentionMetadata, step: StepSpec) -> torch.Tensor:
    """vLLM token of each step row (the rows KV is written from), -1 for PCP pads.

    Without PCP step rows are the local rows. Under PCP they are the decode rows, then each
    prefill's padded tokens in order (the restored all-gather of every rank's chunks).
    """
    nd = meta.num_decode_tokens
    if meta.pcp_partition is None:
        return meta.local_token_idx[:meta.num_local_rows]
    req, pos = meta.pcp_partition.restored_rows(meta.chunk_lens)
    req = meta.prefill_reqs[req]
    new = step.scheduled[req]
    tokens = np.where(pos < new, step.cu_new_tokens[req] + pos, -1)
    return torch.cat([meta.local_token_idx[:nd], torch.from_numpy(tokens.astype(np.int64))])


def slots_in_vllm_order(meta: AttentionMetadata, num_tokens: int, step: StepSpec) -> torch.Tensor:
    """Our step slot mapping, re-indexed by vLLM token ([num_tokens] int64; -1 = not stored).

    Raises if a token is written by no step row or by two (PCP: every token exactly once)."""
    rows = step_row_tokens(meta, step)
    if rows.numel() == num_tokens and torch.equal(rows, torch.arange(num_tokens, dtype=rows.dtype)):
        return meta.step_slot_mapping[:num_tokens]  # rows are vLLM's tokens in order, each once
    out = torch.full((num_tokens,), -1, dtype=torch.int64)
    real = rows >= 0
    count = torch.bincount(rows[real], minlength=num_tokens)
    if count.numel() != num_tokens or bool((count != 1).any()):
        bad = int(torch.nonzero(count != 1)[0, 0])
        raise SlotMappingMismatch(f"token {bad} has {int(count[bad])} step rows (expected 1)")
    out[rows[real]] = meta.step_slot_mapping[:rows.numel()][real]
    return out


def check_slot_mapping(meta: AttentionMetadata, vllm_slots: torch.Tensor, num_tokens: int,
                       step: StepSpec, where: str = "") -> None:
    """Raise :class:`SlotMappingMismatch` unless vLLM's slots equal ours for every token."""
    ours = slots_in_vllm_order(meta, num_tokens, step)
    theirs = vllm_slots[:num_tokens].to(device="cpu", dtype=torch.int64)
    if torch.equal(ours, theirs):
        return
    bad = int(torch.nonzero(ours != theirs)[0, 0])
    cu = step.cu_new_tokens
    req = int(np.searchsorted(cu, bad, side="right") - 1)
    pos = step.num_computed_tokens[req] + bad - int(cu[req])
    raise SlotMappingMismatch(
        f"{where}vLLM's slot_mapping disagrees with cp_attention's for token {bad} (request "
        f"{req}, position {pos}): vLLM slot {int(theirs[bad])}, ours {int(ours[bad])} "
        f"({int((ours != theirs).sum())} of {num_tokens} tokens differ). The KV cache layouts "
        "disagree (block size, DCP size/rank or interleave); refusing to write the cache.")
