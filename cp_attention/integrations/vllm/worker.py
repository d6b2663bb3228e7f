"""PCP worker: vLLM's CPU worker with :class:`~.model_runner.PCPCPUModelRunner`.

``CPUWorker.init_device`` builds a ``CPUModelRunner`` itself (``vllm/v1/worker/cpu_worker.py:177``);
this worker replaces it by the PCP runner right after. Selected automatically for pcp > 1 when
the plugin is enabled (:mod:`.config_hook`), or explicitly with
``--worker-cls cp_attention.integrations.vllm.worker.PCPCPUWorker``.
"""
from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from cp_attention.integrations.vllm.model_runner import PCPCPUModelRunner


class PCPCPUWorker(CPUWorker):
    """CPU worker whose model runner runs each PCP rank's rows only."""

    def init_device(self) -> None:
        super().init_device()
        self.model_runner = PCPCPUModelRunner(self.vllm_config, self.model_runner.device)
