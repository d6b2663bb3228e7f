"""vLLM ``AttentionBackend`` that runs cp_attention's impls (imports vLLM; loaded by vLLM only).

KV cache: vLLM hands each layer a ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
tensor (layout LBHNC). We keep K in ``[..., :head_size]`` and V in ``[..., head_size:]`` and
present them to our ops as the strided view ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` (no copy). This backend writes the cache itself inside ``forward``
(``forward_includes_kv_cache_update = True``), with the slot mapping of our metadata, which
the builder checks equals vLLM's for every step (under PCP too: every token written exactly
once, with vLLM's slot, on every PCP rank).

PCP: vLLM hands the builder the global batch; our metadata's rows for this PCP rank are what
:class:`~.model_runner.PCPCPUModelRunner` feeds the model, so under PCP the impl receives
exactly our local rows (no permutation). Per-step handshake: the runner sets
``CPVllmMetadata.local_rows_fed`` right before it runs the model on those rows, and the impl
raises :class:`PCPRowsNotSelected` on a PCP step without it (e.g. a vLLM whose runner no longer
calls the overridden ``_model_forward`` would otherwise attend the global rows silently). Config mapping of both vLLM PCP layouts:
:func:`~.adapter.cp_config_from_vllm`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.distributed.parallel_state import get_dcp_group, get_pcp_group, get_tp_group
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_interface import KVCacheLayout

from cp_attention import envs
from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig, CPRanks
from cp_attention.integrations.vllm import LOGGER_NAME
from cp_attention.integrations.vllm.adapter import (check_slot_mapping, engine_cp_config,
                                                    expected_vllm_dcp_rank, row_order,
                                                    step_from_vllm, window_kv_replicated)
from cp_attention.integrations.vllm.shm import impl_communicator
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.metadata.common import StepSpec
from cp_attention.parallel import CPGroups

log = logging.getLogger(LOGGER_NAME)
OPS_KINDS = {"cpu": "C++ CPU kernels", "reference": "pure-torch fallback"}  # AttentionOps.name


class PCPRowsNotSelected(RuntimeError):
    """A PCP step reached the impl without the PCP model runner selecting this rank's rows."""


def vllm_ranks(config: CPConfig) -> CPRanks:
    """This worker's coordinates from vLLM's parallel state, checked against the mapping."""
    tp_rank = get_tp_group().rank_in_group if config.tp_size > 1 else 0
    pcp_rank = get_pcp_group().rank_in_group if config.pcp_size > 1 else 0
    dcp_rank = tp_rank % config.dcp_size
    vllm_dcp = get_dcp_group()
    expected = expected_vllm_dcp_rank(config, pcp_rank, tp_rank)
    # a KV kept whole on every rank (kv_world 1) has no DCP rank of its own to check
    if vllm_dcp.world_size > 1 and config.kv_world > 1 and vllm_dcp.rank_in_group != expected:
        raise RuntimeError(f"vLLM DCP rank {vllm_dcp.rank_in_group} (pcp rank {pcp_rank}, tp rank "
                           f"{tp_rank}) is not the {expected} cp_attention's mapping expects: "
                           "unexpected group layout")
    return CPRanks(pcp_rank=pcp_rank, tp_rank=tp_rank, dcp_rank=dcp_rank)


def vllm_groups(config: CPConfig) -> CPGroups:
    """CPGroups over vLLM's gloo (``cpu_group``) TP, PCP and DCP groups.

    Our DCP group is vLLM's when pcp == 1; with vLLM dcp == pcp our dcp is 1 and vLLM's DCP
    group (the same ranks as the PCP group) is our KV group.
    """
    tp = get_tp_group().cpu_group if config.tp_size > 1 else None
    pcp = get_pcp_group().cpu_group if config.pcp_size > 1 else None
    dcp = get_dcp_group().cpu_group if config.dcp_size > 1 else None
    kv = get_dcp_group().cpu_group if config.kv_world > 1 else None
    return CPGroups(config, vllm_ranks(config), torch.device("cpu"), pcp_group=pcp,
                    tp_group=tp, dcp_group=dcp, kv_group=kv)


def layer_windows(vllm_config: VllmConfig, layer_names: list[str], kv_cache_spec) -> list:
    """The distinct sliding windows (None: full attention) of a builder's layers, first layer's
    first. Usually one, the spec's; but with the hybrid KV cache manager off vLLM promotes the
    sliding-window specs to full attention and puts every layer in one KV cache group, whose
    merged spec carries the window of some layers (``FullAttentionSpec.merge``,
    ``vllm/v1/kv_cache_interface.py``; ``unify_hybrid_kv_cache_specs``) while each layer keeps
    its own (Gemma 3: 512 on 15 layers, None on 3)."""
    spec_window = getattr(kv_cache_spec, "sliding_window", None)
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
    return list(dict.fromkeys(getattr(layers.get(name), "sliding_window", spec_window)
                              for name in layer_names)) or [spec_window]


def kv_cache_view(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """[num_blocks, H, block_size, 2D] -> strided view [2, num_blocks, block_size, H, D]."""
    return kv_cache.unflatten(-1, (2, head_size)).permute(3, 0, 2, 1, 4)


class CPVllmBackend(AttentionBackend):
    """cp_attention as vLLM's CPU attention backend (registered over ``CPU_ATTN``)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # Attention.__init__ looks the name up in AttentionBackendEnum

    @staticmethod
    def get_impl_cls() -> type["CPVllmImpl"]:
        return CPVllmImpl

    @staticmethod
    def get_builder_cls() -> type["CPVllmMetadataBuilder"]:
        return CPVllmMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size (the C++ CPU kernels and the torch fallback take any)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,)


@dataclass
class KVShardStats:
    """What this rank stored and what its decode rows attended, summed over the steps built."""

    steps: int = 0
    tokens_stored: int = 0  # new tokens written to this rank's cache
    tokens: int = 0  # new tokens of the steps (every rank's)
    decode_keys: int = 0  # cached keys the decode rows attend on this rank
    decode_context: int = 0  # the decode requests' cached tokens (all shards)

    def add(self, meta: AttentionMetadata, step: StepSpec, num_tokens: int) -> bool:
        """Count one step; True on steps 1, 2, 4, 8, ... (when to log)."""
        self.steps += 1
        self.tokens_stored += int((meta.step_slot_mapping >= 0).sum())
        self.tokens += num_tokens
        self.decode_keys += int(meta.ctx_seq_lens[:meta.num_decodes].sum())
        self.decode_context += int(step.computed[meta.decode_reqs].sum())
        return self.steps & (self.steps - 1) == 0


@dataclass
class CPVllmMetadata:
    """Our per-rank metadata plus what the impl needs to map rows back to vLLM's order."""

    inner: AttentionMetadata  # inner.num_local_rows: the rows the layer attends (vLLM's real
    # tokens without PCP; the rest of its input is vLLM's batch padding)
    row_idx: torch.Tensor | None  # [num_local_rows] vLLM token of each of our rows; None = same
    slot_mapping: torch.Tensor  # vLLM's (kept for code that reads it generically)
    num_vllm_tokens: int  # vLLM's real tokens of the step
    last_token_idx: torch.Tensor  # [num_reqs] vLLM token index of each request's last new token
    local_rows_fed: bool = False  # PCP: set by the PCP runner as it feeds this rank's rows
    # layers of several windows in one group (hybrid KV cache manager off): window -> metadata
    # built with it (``inner`` is the first); rows, slots and PCP plan do not depend on it
    by_window: dict | None = None


class CPVllmMetadataBuilder(AttentionMetadataBuilder[CPVllmMetadata]):
    """Builds our metadata from vLLM's ``CommonAttentionMetadata`` and checks the slots."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        windows = layer_windows(vllm_config, layer_names, kv_cache_spec)
        # a group vLLM keeps whole on every DCP rank: our get_kv_cache_spec marks the window
        # layers' so (window_kv_replicated); their impls chose the same config by that rule
        replicated = (not kv_cache_spec.dcp_sharded
                      and vllm_config.parallel_config.decode_context_parallel_size > 1)
        if replicated != (window_kv_replicated(vllm_config) and None not in windows):
            raise RuntimeError(
                f"KV cache group of layers {layer_names[:3]}... (sliding windows {windows}) is "
                f"{'replicated on' if replicated else 'sharded over'} the DCP ranks, but its "
                "layers' impls expect otherwise (window_kv_replicated): were the KV cache specs "
                "made by cp_attention's PCP model runner?")
        self.config = engine_cp_config(vllm_config, replicated)  # the impls' object too
        if kv_cache_spec.block_size != self.config.block_size:
            raise RuntimeError(f"vLLM's kernel block size {kv_cache_spec.block_size} != its "
                               f"--block-size {self.config.block_size}: cp_attention needs one")
        # vLLM puts requests of <= threshold tokens first, as our rows put decodes; None keeps
        # vLLM's batch order (rows are permuted)
        self.reorder_batch_threshold = (self.config.decode_threshold
                                        if envs.CP_ATTENTION_VLLM_REORDER else None)
        ranks = vllm_ranks(self.config)
        self.inners = {window: CPAttentionBackend.get_builder_cls()(
            self.config, ranks, sliding_window=window) for window in windows}
        self.inner = next(iter(self.inners.values()))
        self._reorder_seen = False
        self.kv_stats = KVShardStats()
        log.info("cp_attention metadata builder: %s, ranks %s, layers %d, sliding windows %s, "
                 "KV %s", self.config, self.inner.ranks, len(layer_names), list(self.inners),
                 "replicated on every DCP rank" if replicated else
                 f"sharded over {self.config.kv_world} rank(s)")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPVllmMetadata:
        cm = common_attn_metadata
        step = step_from_vllm(cm.query_start_loc_cpu, cm.seq_lens.cpu(),
                               cm.block_table_tensor.cpu(), cm.num_reqs)
        by_window = {window: inner.build(step) for window, inner in self.inners.items()}
        meta = next(iter(by_window.values()))
        check_slot_mapping(meta, cm.slot_mapping, step.num_new_tokens, step,
                           where=f"[rank {self.inner.ranks}] ")
        stats = self.kv_stats
        if stats.add(meta, step, step.num_new_tokens):
            log.info("cp_attention KV shard %d/%d: stored %d of %d new tokens, decode rows "
                     "attended %d of %d cached keys (%d steps)", self.inner.kv_rank,
                     self.config.kv_world, stats.tokens_stored, stats.tokens, stats.decode_keys,
                     stats.decode_context, stats.steps)
        rows = row_order(meta, step.num_new_tokens) if self.config.pcp_size == 1 else None
        log.debug("cp_attention step: computed %s new %s reordered %s",
                  step.num_computed_tokens, step.num_scheduled_tokens, rows is not None)
        if rows is not None and not self._reorder_seen:
            self._reorder_seen = True
            log.info("cp_attention: row order differs from vLLM's batch order (our rows put "
                     "decodes first); rows are gathered and scattered")
        qsl = cm.query_start_loc_cpu[:cm.num_reqs + 1].to(torch.int64)
        return CPVllmMetadata(meta, rows, cm.slot_mapping,
                              step.num_new_tokens, qsl[1:] - 1,
                              by_window=by_window if len(by_window) > 1 else None)


class CPVllmImpl(AttentionImpl[CPVllmMetadata]):
    """Wraps :class:`BaseAttentionImpl` (no CP) or :class:`CPAttentionImpl` (PCP and/or DCP)."""

    can_return_lse_for_decode: bool = True  # the DCP combine merges by LSE (cp_utils.py:51)
    supports_dcp: bool = True
    supports_pcp: bool = True  # with the plugin's PCP model runner (model_runner.py)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra) -> None:
        given = {"alibi_slopes": alibi_slopes, "logits_soft_cap": logits_soft_cap or None,
                 "kv_sharing_target_layer_name": kv_sharing_target_layer_name, **extra}
        unsupported = sorted(name for name, value in given.items() if value is not None)
        if unsupported:
            raise NotImplementedError(f"cp_attention vLLM backend does not support {unsupported};"
                                      " unset CP_ATTENTION_VLLM to use vLLM's own CPU_ATTN")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"cp_attention vLLM backend supports decoder attention "
                                      f"only, got attn_type={attn_type!r}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window
        self._kv_cache: torch.Tensor | None = None  # the layer's cache and its view, made once
        self._kv_view: torch.Tensor | None = None
        vllm_config = get_current_vllm_config()
        # the builder's object too (it checks the window rule against its KV cache group)
        self.config = engine_cp_config(vllm_config, sliding_window is not None
                                       and window_kv_replicated(vllm_config))
        extra_kwargs = {}
        if self.config.uses_cp:
            extra_kwargs = {"groups": vllm_groups(self.config), "dcp_comm_backend":
                            vllm_config.parallel_config.dcp_comm_backend or "ag_rs",
                            "comm": impl_communicator(self.config.pcp_size)}
        self.inner = CPAttentionBackend.get_impl_cls(self.config)(
            num_heads, head_size, scale, self.num_kv_heads, sliding_window=sliding_window,
            attn_type="decoder", kv_cache_dtype=kv_cache_dtype, **extra_kwargs)
        vllm_dcp = vllm_config.parallel_config.decode_context_parallel_size
        if self.dcp_world_size != vllm_dcp:
            raise RuntimeError(f"vLLM DCP world {self.dcp_world_size} != config {vllm_dcp}")
        ops = self.inner.ops
        log.info("cp_attention impl active: %s, ops %s (%s), heads %d/%d (q/kv on this rank), "
                 "dcp rank %d/%d, pcp rank %d/%d, kv_shard %s, dcp_comm_backend %s",
                 type(self.inner).__name__, type(ops).__name__, OPS_KINDS.get(ops.name, ops.name),
                 num_heads, self.num_kv_heads, self.dcp_rank, self.dcp_world_size,
                 self.pcp_rank, self.pcp_world_size, self.config.kv_shard,
                 getattr(self.inner, "dcp_comm_backend", "-"))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CPVllmMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D], output [T, Hq, D] (T may be padded)."""
        if attn_metadata is None:  # profiling / warm-up run: nothing to attend
            return output
        meta, n = attn_metadata, attn_metadata.inner.num_local_rows
        if self.config.pcp_size > 1 and not (meta.local_rows_fed and query.shape[0] == n):
            raise PCPRowsNotSelected(
                f"PCP rank {self.pcp_rank}: the layer got {query.shape[0]} rows, this step's "
                f"metadata has {n} local rows and local_rows_fed={meta.local_rows_fed}: the PCP "
                "model runner (PCPCPUModelRunner._model_forward) did not select this rank's "
                "rows; is the vLLM runner still calling _model_forward (vLLM 0.32)?")
        if kv_cache is not self._kv_cache:  # the same tensor every step: view it once
            if kv_cache.shape[2] != self.config.block_size:
                raise RuntimeError(f"KV cache block size {kv_cache.shape[2]} != metadata block "
                                   f"size {self.config.block_size}")
            self._kv_cache, self._kv_view = kv_cache, kv_cache_view(kv_cache, self.head_size)
        cache = self._kv_view
        inner = meta.inner if meta.by_window is None else meta.by_window[self.sliding_window]
        rows = meta.row_idx
        if rows is None:
            if n != query.shape[0]:  # padded batch: the real rows only
                query, key, value, output_rows = query[:n], key[:n], value[:n], output[:n]
            else:
                output_rows = output
            self.inner.forward(layer, query, key, value, cache, inner, output=output_rows,
                               output_scale=output_scale, output_block_scale=output_block_scale)
            return output
        out = torch.empty_like(output[:n])
        self.inner.forward(layer, query[rows], key[rows], value[rows], cache, inner,
                           output=out, output_scale=output_scale,
                           output_block_scale=output_block_scale)
        output[rows] = out
        return output
