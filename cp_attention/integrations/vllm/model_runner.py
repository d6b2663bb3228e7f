"""PCP model runner: vLLM's CPU runner with the model run on this PCP rank's rows only.

vLLM's V1 runner keeps building the *global* batch (inputs, positions, our metadata through
the backend's builder). :meth:`PCPCPUModelRunner._model_forward` (documented as overridable,
``vllm/v1/worker/gpu_model_runner.py:3620``) runs the model on this rank's rows
(``AttentionMetadata.local_token_idx`` / ``positions``: decodes, then each prefill's head and
tail chunks, pads included), then restores the hidden states vLLM reads next:
``execute_model`` takes ``hidden_states[logits_indices]`` (``:4241``), i.e. the last new token
of each request (with speculative decoding every verified row: each draft and the bonus
position, kept by :meth:`PCPCPUModelRunner._prepare_inputs`), and, for requests with prompt
logprobs, ``hidden_states[:num_tokens]`` (``:3589``). Only those rows are gathered: one
all-gather over the PCP group of ``[wanted rows, hidden + 1]`` (hidden row, or zeros, and a
"held here" flag); each wanted row is taken from the first rank that holds it. Every other
row of the returned tensor is zero. Before running the model it marks the step's metadata
(``CPVllmMetadata.local_rows_fed``); the impl refuses a PCP step without that mark
(:class:`~.backend.PCPRowsNotSelected`), so a vLLM whose runner stopped calling
``_model_forward`` fails instead of attending the wrong rows.

Private vLLM names relied on (vLLM 0.32.0): ``GPUModelRunner._model_forward`` (override),
``GPUModelRunner._prepare_inputs`` (wrapped; returns ``logits_indices, spec_decode_metadata,
max_num_sampled_tokens``, ``gpu_model_runner.py:1920``),
``GPUModelRunner.num_prompt_logprobs`` (runner dict, ``gpu_model_runner.py:686``),
``CPUModelRunner`` (``vllm/v1/worker/cpu_model_runner.py:23``), ``get_forward_context()``
(``vllm/forward_context.py``), ``get_pcp_group().cpu_group``.

Debug switch ``CP_ATTENTION_VLLM_CHECK_TOKENS=1``: after every step all PCP ranks compare the
tokens they sampled (all-gather of Python objects over the PCP group) and raise
:class:`PCPTokenMismatch` naming the step and ranks if they differ.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import get_pcp_group
from vllm.forward_context import get_forward_context
from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from cp_attention import envs
from cp_attention.integrations.vllm import LOGGER_NAME
from cp_attention.integrations.vllm.adapter import (local_input_rows, pack_held_rows,
                                                    pick_held_rows, rows_holding,
                                                    window_kv_replicated)
from cp_attention.integrations.vllm.backend import CPVllmMetadata
from cp_attention.integrations.vllm.logits import split_lm_head
from cp_attention.integrations.vllm.shm import pcp_communicator

log = logging.getLogger(LOGGER_NAME)


class PCPTokenMismatch(RuntimeError):
    """PCP ranks sampled different tokens in one step."""


@dataclass
class RestoreStats:
    """Bytes this rank sent to restore hidden states (ring all-gather accounting)."""

    steps: int = 0
    bytes_sent: int = 0  # the wanted rows (what this runner gathers)
    bytes_all_rows: int = 0  # what gathering every local row would have sent


def _our_metadata(attn_metadata) -> list[CPVllmMetadata]:
    """The cp_attention metadata objects of this step (rows do not depend on the layer)."""
    if not isinstance(attn_metadata, dict):
        return []
    return [meta for meta in attn_metadata.values() if isinstance(meta, CPVllmMetadata)]


class PCPCPUModelRunner(CPUModelRunner):
    """CPU model runner for ``--prefill-context-parallel-size > 1`` with cp_attention."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pcp_group = get_pcp_group()
        self.pcp_comm = pcp_communicator()  # the hidden restore and the lm_head's all-gather
        self.restore_stats = RestoreStats()
        self.check_tokens = envs.CP_ATTENTION_VLLM_CHECK_TOKENS
        self.sample_step = 0
        # vLLM's logits_indices of this step when it verifies drafts (speculative decoding),
        # else None: set by _prepare_inputs, read (once) by _restore_hidden
        self.spec_logits_indices: torch.Tensor | None = None
        log.info("cp_attention PCP model runner: pcp rank %d/%d, token check %s",
                 self.pcp_group.rank_in_group, self.pcp_group.world_size,
                 "on" if self.check_tokens else "off")

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's load, then the lm_head split over the PCP ranks (:mod:`.logits`)."""
        super().load_model(*args, **kwargs)
        group = self.pcp_group
        split_lm_head(self.model, group.rank_in_group, group.world_size,
                      lambda part: self.pcp_comm.all_gather(part, group.cpu_group, dim=1))

    def get_kv_cache_spec(self):
        """vLLM's specs, with the sliding-window layers' KV kept whole on every DCP rank
        (``dcp_sharded=False``) when :func:`~.adapter.window_kv_replicated` says so."""
        specs = super().get_kv_cache_spec()
        if not window_kv_replicated(self.vllm_config):
            return specs
        return {name: replace(spec, dcp_sharded=False) if isinstance(spec, SlidingWindowSpec)
                else spec for name, spec in specs.items()}

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        """vLLM's, then the block tables of groups kept whole on every DCP rank compute their
        slot mapping as at dcp = 1: vLLM 0.32's V1 ``BlockTable`` shards every group's slots
        by its DCP world (``vllm/v1/worker/block_table.py:176``; its V2 runner passes each
        group's ``dcp_sharded`` instead). The builder checks every step's slots against ours."""
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        tables = self.input_batch.block_table.block_tables
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if not spec.dcp_sharded:
                tables[index].dcp_world_size, tables[index].dcp_rank = 1, 0
            self._log_kv_group(index, group, kv_cache_config.num_blocks)

    def _log_kv_group(self, index: int, group, num_blocks: int) -> None:
        """One line per KV cache group: its layers' kind and the KV bytes this rank holds."""
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            return
        dcp = self.vllm_config.parallel_config.decode_context_parallel_size
        shards = dcp if spec.dcp_sharded else 1
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        log.info("cp_attention KV cache group %d: %d %s layers, %s; %d bytes per token per "
                 "layer of a request's context on this rank (page %d bytes per %d-token block, "
                 "%d blocks)", index, len(group.layer_names),
                 f"sliding-window ({window})" if window else "full-attention",
                 f"sharded over {shards} DCP ranks" if shards > 1 else
                 "whole on every rank" + (" (replicated over DCP)" if dcp > 1 else ""),
                 spec.page_size_bytes // spec.block_size // shards, spec.page_size_bytes,
                 spec.block_size, num_blocks)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        """vLLM's, keeping ``logits_indices`` of a step with speculative decoding: the
        rejection sampler reads the hidden states of every verified row (each draft and the
        bonus position, ``gpu_model_runner.py:2223-2226``), not only each request's last one."""
        logits_indices, spec_decode_metadata, max_sampled = super()._prepare_inputs(
            scheduler_output, num_scheduled_tokens)
        self.spec_logits_indices = (None if spec_decode_metadata is None
                                    else logits_indices.to("cpu", torch.int64))
        return logits_indices, spec_decode_metadata, max_sampled

    def _model_forward(self, input_ids: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None, intermediate_tensors=None,
                       inputs_embeds: torch.Tensor | None = None, **model_kwargs):
        """Run the model on this rank's rows; return [num_rows, hidden] with the rows vLLM
        reads restored over the PCP group (input_ids [T] / inputs_embeds [T, E], positions [T])."""
        metas = _our_metadata(get_forward_context().attn_metadata)
        if not metas:  # no attention metadata (profiling / dummy runs): all rows everywhere
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)
        meta = metas[0]
        token_idx, local_positions = local_input_rows(meta.inner)
        for each in metas:  # the handshake the impl checks on every PCP layer call
            each.local_rows_fed = True
        hidden = super()._model_forward(
            input_ids[token_idx] if input_ids is not None else None,
            local_positions.to(positions.device, positions.dtype),
            intermediate_tensors,
            inputs_embeds[token_idx] if inputs_embeds is not None else None,
            **model_kwargs)
        num_rows = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        return self._restore_hidden(hidden, meta, num_rows)

    def _restore_hidden(self, hidden: torch.Tensor, meta: CPVllmMetadata,
                        num_rows: int) -> torch.Tensor:
        """hidden [local rows, H] -> [num_rows, H] in vLLM's token order (wanted rows only)."""
        spec_rows, self.spec_logits_indices = self.spec_logits_indices, None
        if self.num_prompt_logprobs:  # prompt logprobs read every token's hidden state
            wanted = torch.arange(meta.num_vllm_tokens)
        elif spec_rows is not None:  # speculative decoding: every row the sampler verifies
            if spec_rows.numel() and int(spec_rows.max()) >= meta.num_vllm_tokens:
                raise RuntimeError(f"hidden-state restore: vLLM's logits_indices reach row "
                                   f"{int(spec_rows.max())} of a {meta.num_vllm_tokens}-token "
                                   "step (stale speculative indices)")
            wanted = torch.unique(torch.cat([spec_rows, meta.last_token_idx.to(torch.int64)]))
        else:
            wanted = meta.last_token_idx
        held = rows_holding(meta.inner, wanted)
        out = hidden.new_zeros((num_rows, hidden.shape[-1]))
        stats = self.restore_stats
        stats.steps += 1
        if not len(meta.inner.prefill_reqs):  # decode rows run on every PCP rank, identically:
            if bool((held < 0).any()):    # each rank has them all and no rank gathers
                raise RuntimeError("hidden-state restore: a decode token is missing on this "
                                   "PCP rank (row plan and vLLM batch disagree)")
            out[wanted] = hidden[held]
            return out
        world = self.pcp_group.world_size
        packed = pack_held_rows(hidden, held)
        before = self.pcp_comm.total_bytes
        gathered = self.pcp_comm.all_gather(packed, self.pcp_group.cpu_group)
        out[wanted] = pick_held_rows(gathered.view(world, *packed.shape), wanted)
        stats.bytes_sent += self.pcp_comm.total_bytes - before
        stats.bytes_all_rows += (world - 1) * hidden.shape[0] * hidden.shape[1] * hidden.element_size()
        if meta.inner.pcp_partition is not None and meta.inner.num_local_prefill_rows:
            log.info("cp_attention hidden restore: step %d, %d wanted rows of %d tokens, "
                     "%d bytes sent (all %d local rows: %d); totals %d vs %d bytes over %d steps",
                     stats.steps, wanted.numel(), meta.num_vllm_tokens,
                     self.pcp_comm.total_bytes - before, hidden.shape[0],
                     (world - 1) * hidden.shape[0] * hidden.shape[1] * hidden.element_size(),
                     stats.bytes_sent, stats.bytes_all_rows, stats.steps)
        return out

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        if self.check_tokens:
            self._check_same_tokens(output)
        self.sample_step += 1
        return output

    @staticmethod
    def _sampled_tokens(output) -> list[list[int]] | None:
        """Token ids this rank sampled, one list per request (None: the step sampled none)."""
        sampled = getattr(output, "sampled_token_ids", None)
        return None if sampled is None else [[int(t) for t in req] for req in sampled]

    def _check_same_tokens(self, output) -> None:
        """Raise :class:`PCPTokenMismatch` unless every PCP rank sampled the same tokens."""
        tokens = self._sampled_tokens(output)
        if tokens is None:
            return
        everyone: list = [None] * self.pcp_group.world_size
        dist.all_gather_object(everyone, tokens, group=self.pcp_group.cpu_group)
        for other, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise PCPTokenMismatch(
                    f"step {self.sample_step}: PCP ranks 0 and {other} sampled different tokens "
                    f"({everyone[0]} vs {theirs}); CP_ATTENTION_VLLM_CHECK_TOKENS=1")
