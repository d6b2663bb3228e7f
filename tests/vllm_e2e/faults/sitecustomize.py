"""Test-only fault injection for the vLLM e2e negative controls (never part of the package).

``harness.Runs`` puts this directory first on ``PYTHONPATH`` of a run whose spec names a fault
and sets ``CP_E2E_FAULT=<name>``. Python imports ``sitecustomize`` at the start of every
interpreter, so the fault reaches each process vLLM starts (its CPU platform spawns fresh
workers, ``vllm/platforms/cpu.py:409``, where a monkeypatch of the test process would not).
Here we only wrap the plugin's ``register`` (no vLLM import at interpreter start); vLLM calls
it in every process after importing itself (``vllm/plugins/__init__.py:77``), and the wrapper
then patches the plugin's classes once per process and logs the fault on the plugin's logger.

Faults (each breaks one thing the e2e tests must notice):
  * ``skip_dcp_combine``: the DCP impl keeps its own KV shard's partial (no combine);
  * ``skip_hidden_restore``: the PCP runner keeps only its own rows' hidden states;
  * ``perturb_tokens``: PCP rank 1 reports a wrong first token to the token check;
  * ``runner_skips_model_forward``: the PCP runner's ``_model_forward`` override is not called
    (as if vLLM renamed the method): the impl gets the global rows and must refuse them;
  * ``spec_shorten_accepted``: on PCP rank 1 vLLM's rejection sampler drops the last accepted
    token of the first request that accepted a draft (a corrupted accepted length);
  * ``spec_restore_last_rows_only``: the PCP runner forgets vLLM's speculative logits_indices
    and restores only each request's last row (the draft rows' hidden states stay zero).
"""
from __future__ import annotations

import logging
import os

ENV_FAULT = "CP_E2E_FAULT"


def skip_dcp_combine() -> str:
    from cp_attention.comm import group_rank, group_size
    from cp_attention.impl import context

    def own_heads_only(comm, out, lse, dcp_group):  # this rank's heads over its shard only
        dcp = group_size(dcp_group)
        mine = slice(group_rank(dcp_group) * out.shape[1] // dcp,
                     (group_rank(dcp_group) + 1) * out.shape[1] // dcp)
        return out[:, mine], lse[:, mine]

    context.combine_dcp_ag_rs = context.combine_dcp_a2a = own_heads_only
    return "DCP partials are NOT combined (results are wrong)"


def skip_hidden_restore() -> str:
    from cp_attention.integrations.vllm.adapter import rows_holding
    from cp_attention.integrations.vllm.model_runner import PCPCPUModelRunner

    def local_rows_only(self, hidden, meta, num_rows):
        wanted = meta.last_token_idx
        held = rows_holding(meta.inner, wanted)
        out = hidden.new_zeros((num_rows, hidden.shape[-1]))
        mine = held >= 0
        out[wanted[mine]] = hidden[held[mine]]
        return out

    PCPCPUModelRunner._restore_hidden = local_rows_only
    return "hidden states are NOT restored over PCP (wrong results)"


def perturb_tokens() -> str:
    from cp_attention.integrations.vllm.model_runner import PCPCPUModelRunner

    sampled = PCPCPUModelRunner._sampled_tokens

    def perturbed(self, output):
        tokens = sampled(output)
        if tokens and tokens[0] and self.pcp_group.rank_in_group == 1:
            tokens[0][0] += 1
        return tokens

    PCPCPUModelRunner._sampled_tokens = perturbed
    return "PCP rank 1 reports a wrong token to the token check"


def runner_skips_model_forward() -> str:
    from cp_attention.integrations.vllm.model_runner import PCPCPUModelRunner

    del PCPCPUModelRunner._model_forward  # vLLM's own _model_forward runs: all rows
    return "the PCP runner's _model_forward override is bypassed (global rows reach the impl)"


def spec_shorten_accepted() -> str:
    from vllm.distributed.parallel_state import get_pcp_group
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    forward = RejectionSampler.forward

    def shortened(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if get_pcp_group().rank_in_group == 1:
            ids = out.sampled_token_ids  # [num_reqs, 1 + k], -1 past the accepted tokens
            valid = (ids >= 0).sum(dim=1)
            longer = (valid >= 2).nonzero().flatten()
            if longer.numel():
                row = int(longer[0])
                ids[row, int(valid[row]) - 1] = -1
        return out

    RejectionSampler.forward = shortened
    return "PCP rank 1 drops one accepted speculative token"


def spec_restore_last_rows_only() -> str:
    from cp_attention.integrations.vllm.model_runner import PCPCPUModelRunner

    prepare = PCPCPUModelRunner._prepare_inputs

    def forgetful(self, *args, **kwargs):
        out = prepare(self, *args, **kwargs)
        self.spec_logits_indices = None
        return out

    PCPCPUModelRunner._prepare_inputs = forgetful
    return "the PCP runner restores only the last row of each request (draft rows zero)"


FAULTS = {f.__name__: f for f in (skip_dcp_combine, skip_hidden_restore, perturb_tokens,
                                  runner_skips_model_forward, spec_shorten_accepted,
                                  spec_restore_last_rows_only)}


def _install(name: str) -> None:
    if name not in FAULTS:
        raise ValueError(f"{ENV_FAULT}={name!r}: known faults {sorted(FAULTS)}")
    import cp_attention.integrations.vllm as plugin

    register, done = plugin.register, []

    def register_with_fault() -> None:
        register()
        if not done:
            done.append(name)
            what = FAULTS[name]()
            logging.getLogger(plugin.LOGGER_NAME).warning("test fault %s: %s", name, what)

    plugin.register = register_with_fault


if os.environ.get(ENV_FAULT):
    _install(os.environ[ENV_FAULT])
