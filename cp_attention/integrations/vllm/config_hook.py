"""Start-up hook for PCP: lift vLLM's V1-runner refusal, refuse what we cannot run, pick our worker.

vLLM 0.32 refuses ``--prefill-context-parallel-size > 1`` on the V1 model runner while it
builds ``VllmConfig``: ``_validate_v1_model_runner`` (``vllm/config/vllm.py:3198-3203``, called
at ``:2020``) raises if ``_get_v1_model_runner_unsupported_features`` (``:2955-2960``) lists
"prefill context parallel". :func:`install_pcp_config_hook` wraps that method: with pcp > 1 it
drops vLLM's entry and adds one entry per combination cp_attention's PCP does not run (each
names the flag), so vLLM raises ``ValueError: Model Runner V1 does not support: ...`` at start-up
instead of producing a wrong answer. When nothing is left it selects the PCP worker
(``parallel_config.worker_cls``, which the CPU platform set to its ``CPUWorker`` just before,
``vllm/platforms/cpu.py:343``, ``vllm/config/vllm.py:1991``).

Imports vLLM; loaded only by :func:`cp_attention.integrations.vllm.register`.
"""
from __future__ import annotations

from vllm.config import VllmConfig

from cp_attention.integrations.vllm.adapter import UnsupportedLayout, cp_config_from_vllm

VLLM_PCP_FEATURE = "prefill context parallel"  # vLLM's entry (vllm/config/vllm.py:2960)
VLLM_CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
PCP_WORKER = "cp_attention.integrations.vllm.worker.PCPCPUWorker"
_MARK = "_cp_attention_pcp_hook"


def pcp_unsupported(vllm_config: VllmConfig) -> list[str]:
    """What this PCP deployment asks for that cp_attention cannot run, one entry per flag."""
    pc, mc, cc = vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config
    found: list[str] = []

    def refuse(condition: bool, what: str) -> None:
        if condition:
            found.append(f"{what} with --prefill-context-parallel-size > 1 (cp_attention PCP)")

    try:
        cp_config_from_vllm(pc, block_size=cc.block_size or 16)
    except UnsupportedLayout as err:
        found.append(str(err))
    except ValueError:
        pass  # other size errors are vLLM's or the builder's to report
    refuse(vllm_config.speculative_config is not None, "speculative decoding (--speculative-config)")
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
    """Wrap ``VllmConfig._get_v1_model_runner_unsupported_features`` (idempotent)."""
    original = VllmConfig._get_v1_model_runner_unsupported_features
    if getattr(original, _MARK, False):
        return False

    def unsupported_features(self: VllmConfig) -> list[str]:
        found = original(self)
        if self.parallel_config.prefill_context_parallel_size <= 1:
            return found
        found = [f for f in found if f != VLLM_PCP_FEATURE] + pcp_unsupported(self)
        if not found:
            self.parallel_config.worker_cls = PCP_WORKER
        return found

    setattr(unsupported_features, _MARK, True)
    unsupported_features.__wrapped__ = original  # type: ignore[attr-defined]
    VllmConfig._get_v1_model_runner_unsupported_features = unsupported_features
    return True
