"""Start-up hooks for PCP: lift vLLM's refusals of what cp_attention runs, refuse the rest.

vLLM 0.32 refuses ``--prefill-context-parallel-size > 1`` on the V1 model runner while it
builds ``VllmConfig``: ``_validate_v1_model_runner`` (``vllm/config/vllm.py:3198-3203``, called
at ``:2020``) raises if ``_get_v1_model_runner_unsupported_features`` (``:2955-2960``) lists
"prefill context parallel". :func:`install_pcp_config_hook` wraps that method: with pcp > 1 it
drops vLLM's entry and adds one entry per combination cp_attention's PCP does not run (each
names the flag), so vLLM raises ``ValueError: Model Runner V1 does not support: ...`` at start-up
instead of producing a wrong answer. When nothing is left it selects the PCP worker
(``parallel_config.worker_cls``, which the CPU platform set to its ``CPUWorker`` just before,
``vllm/platforms/cpu.py:343``, ``vllm/config/vllm.py:1991``).

vLLM's DCP rules for GQA/MQA models (``ModelConfig.verify_with_parallel_config``,
``vllm/config/model.py:1565-1593``: ``tp > total KV heads``, ``dcp <= tp // KV heads``,
``(heads / KV heads) % dcp == 0``) exist because vLLM shards the KV over TP ranks that hold
duplicate KV heads. With ``--prefill-context-parallel-size P --decode-context-parallel-size P``
cp_attention shards the KV over the PCP ranks instead (``kv_shard="cp"``, every rank keeps its
TP slice of the KV heads), which works for any head count; the hook checks the model against
vLLM's other parallel rules with dcp = 1 for that layout only. Every other DCP layout keeps
vLLM's refusal, with a pointer to the one that runs.

Imports vLLM only inside :func:`install_pcp_config_hook`, called by :func:`cp_attention.integrations.vllm.register`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM is imported lazily, inside install_pcp_config_hook
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

from cp_attention.integrations.vllm.adapter import UnsupportedLayout, engine_cp_config

VLLM_PCP_FEATURE = "prefill context parallel"  # vLLM's entry (vllm/config/vllm.py:2960)
VLLM_CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
PCP_WORKER = "cp_attention.integrations.vllm.worker.PCPCPUWorker"
_MARK = "_cp_attention_pcp_hook"


def kv_sharded_over_pcp(parallel_config: ParallelConfig) -> bool:
    """vLLM pcp = P > 1 with dcp = P: the layout cp_attention runs with the KV over PCP ranks."""
    pcp = parallel_config.prefill_context_parallel_size
    return pcp > 1 and parallel_config.decode_context_parallel_size == pcp


def pcp_unsupported(vllm_config: VllmConfig) -> list[str]:
    """What this PCP deployment asks for that cp_attention cannot run, one entry per flag."""
    pc, mc, cc = vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config
    found: list[str] = []

    def refuse(condition: bool, what: str) -> None:
        if condition:
            found.append(f"{what} with --prefill-context-parallel-size > 1 (cp_attention PCP)")

    try:
        engine_cp_config(vllm_config)  # the builders' and impls' CPConfig
    except UnsupportedLayout as err:
        found.append(str(err))
    except ValueError:
        pass  # other size errors are vLLM's or the builder's to report
    spec = vllm_config.speculative_config
    method = getattr(spec, "method", None) if spec is not None else None
    refuse(spec is not None and method != "ngram",
           f"speculative decoding method {method!r} (--speculative-config; only 'ngram' runs: "
           "a draft model or EAGLE / MTP head keeps its own KV cache, which cp_attention PCP "
           "does not shard or replicate yet)")
    refuse(vllm_config.lora_config is not None, "LoRA (--enable-lora)")
    refuse(pc.pipeline_parallel_size > 1, "pipeline parallel (--pipeline-parallel-size)")
    refuse(pc.data_parallel_size > 1, "data parallel (--data-parallel-size)")
    refuse(pc.use_ubatching, "micro-batching (--enable-dbo / --ubatch-size)")
    refuse(vllm_config.kv_transfer_config is not None, "KV transfer (--kv-transfer-config)")
    refuse(bool(cc.kv_sharing_fast_prefill), "--kv-sharing-fast-prefill")
    if mc is not None:
        refuse(not mc.enforce_eager, "torch.compile / graphs (pass --enforce-eager)")
        refuse(mc.is_multimodal_model, "multimodal models (multimodal input)")
        refuse(mc.is_encoder_decoder, "encoder-decoder models")
        refuse(mc.use_mla, "MLA models (cp_attention serves CPU_ATTN, not MLA)")
        refuse(mc.runner_type != "generate", f"--runner {mc.runner_type}")
    refuse(pc.worker_cls not in ("auto", VLLM_CPU_WORKER, PCP_WORKER),
           f"--worker-cls {pc.worker_cls} (PCP needs {PCP_WORKER})")
    return found


def install_pcp_config_hook() -> bool:
    """Wrap ``VllmConfig._get_v1_model_runner_unsupported_features`` and
    ``ModelConfig.verify_with_parallel_config`` (idempotent; True if it installed either)."""
    from vllm.config import ModelConfig, VllmConfig

    def unsupported_features(self: VllmConfig) -> list[str]:
        found = unsupported_features.__wrapped__(self)
        if self.parallel_config.prefill_context_parallel_size <= 1:
            return found
        found = [f for f in found if f != VLLM_PCP_FEATURE] + pcp_unsupported(self)
        if not found:
            self.parallel_config.worker_cls = PCP_WORKER
        return found

    def verify_with_parallel_config(self: ModelConfig, parallel_config: ParallelConfig) -> None:
        verify = verify_with_parallel_config.__wrapped__
        dcp = parallel_config.decode_context_parallel_size
        if dcp > 1 and not self.use_mla and kv_sharded_over_pcp(parallel_config):
            parallel_config.decode_context_parallel_size = 1  # only the DCP-over-TP rules read it
            try:
                return verify(self, parallel_config)
            finally:
                parallel_config.decode_context_parallel_size = dcp
        try:
            return verify(self, parallel_config)
        except ValueError as err:
            if dcp > 1 and "decode-context-parallel-size" in str(err):
                raise ValueError(f"{err} With cp_attention (CP_ATTENTION_VLLM=1), "
                                 f"--prefill-context-parallel-size {dcp} "
                                 f"--decode-context-parallel-size {dcp} shards the KV over the "
                                 "PCP ranks for any KV-head count.") from err
            raise

    installed = _wrap(VllmConfig, "_get_v1_model_runner_unsupported_features",
                      unsupported_features)
    installed |= _wrap(ModelConfig, "verify_with_parallel_config", verify_with_parallel_config)
    return installed


def _wrap(cls: type, name: str, wrapper) -> bool:
    """Install ``wrapper`` as ``cls.name`` (marked, ``__wrapped__`` = the method it replaces)
    unless a marked wrapper is there already; True if it installed."""
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return False
    setattr(wrapper, _MARK, True)
    wrapper.__wrapped__ = original
    setattr(cls, name, wrapper)
    return True
