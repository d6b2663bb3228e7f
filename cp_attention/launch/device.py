"""Which device a launcher runs on: a pure choice from what the host has, and the probe.

:func:`choose_device` decides from plain numbers (devices visible, local rank, ranks per node)
and is what the tests cover; :func:`probe_device_counts` asks torch what this host has;
:func:`select_device` is the two together plus ``set_device``, called once per rank.

``torch_npu`` is imported only when ``npu`` is requested. With ``auto`` an NPU counts only if
torch has already registered ``torch.npu`` (torch's device-backend autoload imports torch_npu at
``import torch`` when it is installed, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``): importing
torch_npu on a host without CANN breaks torch, so ``auto`` never does it itself.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
_ACCELERATORS = ("npu", "cuda")  # the order ``auto`` tries them in


class DeviceUnavailableError(RuntimeError):
    """A device was forced (``--device cuda|npu``) that this host cannot give every rank."""


@dataclass(frozen=True)
class DeviceChoice:
    """The device of one rank; ``note`` says why ``auto`` passed over an accelerator.

    Kept as (type, index) rather than a ``torch.device``: ``torch.device("npu")`` exists only
    once torch_npu is imported, and the choice is made (and tested) without it.
    """

    type: str  # "cpu", "cuda" or "npu"
    index: int | None = None  # None on the CPU
    note: str | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.type if self.index is None else f"{self.type}:{self.index}")

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def choose_device(requested: str, *, cuda_count: int, npu_count: int, local_rank: int,
                  local_world_size: int) -> DeviceChoice:
    """The device of the rank ``local_rank`` of ``local_world_size`` ranks on this node.

    requested: "cpu", "cuda", "npu" or "auto" (npu, then cuda, then cpu). An accelerator is
    used only when every local rank gets its own device (nccl and hccl refuse two ranks on one
    device), so rank ``i`` gets device index ``i``. A forced accelerator that the node lacks
    raises :class:`DeviceUnavailableError`; ``auto`` falls back to the CPU with a note.
    """
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {requested!r}")
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank ({local_rank}) must be in [0, local_world_size="
                         f"{local_world_size})")
    counts = {"cuda": cuda_count, "npu": npu_count}
    if requested == "cpu":
        return DeviceChoice("cpu")
    if requested in counts:
        count = counts[requested]
        if count == 0:
            raise DeviceUnavailableError(f"--device {requested}: no {requested.upper()} device "
                                         "is visible to this process")
        if count < local_world_size:
            raise DeviceUnavailableError(
                f"--device {requested}: {local_world_size} ranks on this node but {count} "
                f"{requested.upper()} device(s); each rank needs its own device")
        return DeviceChoice(requested, local_rank)
    for kind in _ACCELERATORS:
        if counts[kind] >= local_world_size:
            return DeviceChoice(kind, local_rank)
    short = [f"{counts[k]} {k.upper()}" for k in _ACCELERATORS if counts[k]]
    note = (f"{' and '.join(short)} device(s) for {local_world_size} ranks on this node: each "
            "rank needs its own device, so this run uses the CPU") if short else None
    return DeviceChoice("cpu", None, note)


def _npu_count(import_torch_npu: bool) -> int:
    """NPUs visible; imports torch_npu only when ``import_torch_npu`` (``--device npu``)."""
    if import_torch_npu and not hasattr(torch, "npu"):
        try:
            importlib.import_module("torch_npu")  # optional device package, registers torch.npu
        except ImportError as exc:
            raise DeviceUnavailableError(f"--device npu needs torch_npu (and CANN): {exc}") from exc
    npu = getattr(torch, "npu", None)
    return npu.device_count() if npu is not None and npu.is_available() else 0


def probe_device_counts(requested: str) -> tuple[int, int]:
    """(CUDA devices, NPU devices) visible to this process, probing only what ``requested``
    may use."""
    cuda = torch.cuda.device_count() if requested in ("auto", "cuda") else 0
    npu = _npu_count(import_torch_npu=requested == "npu") if requested in ("auto", "npu") else 0
    return cuda, npu


def select_device(requested: str, local_rank: int | None = None,
                  local_world_size: int | None = None) -> DeviceChoice:
    """Choose this rank's device (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE by default) and make
    it the current device of its kind."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda, npu = probe_device_counts(requested)
    choice = choose_device(requested, cuda_count=cuda, npu_count=npu, local_rank=local_rank,
                           local_world_size=local_world_size)
    set_current_device(choice.device)
    return choice


def set_current_device(device: torch.device) -> None:
    """``torch.cuda.set_device`` / ``torch.npu.set_device`` (nccl, hccl need it); no-op on CPU."""
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
