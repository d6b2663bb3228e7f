"""Attention primitives behind one interface; :func:`get_ops` picks the implementation."""
from __future__ import annotations

import torch

from cp_attention.ops.cpu import CpuOps
from cp_attention.ops.cpu_build import forced_reference, load_cpu_extension
from cp_attention.ops.cuda import CudaOps
from cp_attention.ops.interface import AttentionOps, falls_back
from cp_attention.ops.merge import merge_attn_states, merge_many
from cp_attention.ops.npu import NpuOps
from cp_attention.ops.reference import ReferenceOps

__all__ = ["AttentionOps", "CpuOps", "CudaOps", "NpuOps", "ReferenceOps", "get_ops",
           "merge_attn_states", "merge_many"]


def get_ops(device: torch.device | str = "cpu", kind: str = "auto") -> AttentionOps:
    """Ops for ``device``. ``kind``: "auto" (device kernels where available), "reference".

    On CPU, "auto" gives :class:`CpuOps` (C++ kernels, built on first use) unless
    ``CP_ATTENTION_OPS=reference`` is set or the build failed (then ``ReferenceOps``; a failed
    build is a fallback, an error under ``CP_ATTENTION_STRICT_OPS``).
    """
    device = torch.device(device)
    if kind == "reference":
        return ReferenceOps()
    if kind not in ("auto", "cpu", "npu", "cuda"):
        raise ValueError(f"ops kind must be 'auto', 'reference', 'cpu', 'npu' or 'cuda', "
                         f"got {kind!r}")
    if (kind == "auto" and device.type == "cpu") or kind == "cpu":
        extension = load_cpu_extension()
        if extension is not None:
            return CpuOps(extension)
        falls_back("get_ops", None if forced_reference() else "the C++ CPU kernels did not build")
        return ReferenceOps()
    if device.type == "npu" or kind == "npu":
        return NpuOps()  # loads torch_npu on first use
    if device.type == "cuda" or kind == "cuda":
        return CudaOps()  # loads flash_attn when importable
    return ReferenceOps()
