"""The few collectives the CP paths use, with byte accounting.

Every function takes a process group; ``None`` means a group of one rank (identity). Where a
backend lacks a collective, the fallback is chosen up front from the backend's name, never by
catching the collective's error (a failed collective, e.g. a dead peer's timeout, propagates).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

# torch >= 2.13 names the tensor-in/tensor-out collectives *_single; older releases do not.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Backends with a tensor reduce-scatter (gloo's exists in torch 2.13); others: all-reduce + slice.
REDUCE_SCATTER_BACKENDS = frozenset({"gloo", "nccl", "hccl"})
# A same-host all-gather (input, output): output [world n, ...] rank-major, e.g. vLLM CPU's
# shared-memory one; it must be blocking and run by every rank of its group in the same order.
AllGatherInto = Callable[[torch.Tensor, torch.Tensor], None]
SHM_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class Communicator:
    """Runs collectives and counts the bytes this rank sends, per collective name.

    Bytes are those a ring algorithm sends from this rank: all-gather (w-1) x input,
    reduce-scatter and all-to-all (w-1)/w x input, all-reduce 2 (w-1)/w x input.
    reduce_scatter_backends: backends whose tensor reduce-scatter is used; on the others
    ``reduce_scatter`` is an all-reduce and a slice.
    shm_all_gather: groups whose blocking :meth:`all_gather` of floating tensors runs a
    same-host :data:`AllGatherInto` instead of the group's backend (tens of microseconds
    instead of gloo's hundreds for the small per-layer exchanges of decode steps).
    """

    bytes_sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    reduce_scatter_backends: frozenset[str] = REDUCE_SCATTER_BACKENDS
    shm_all_gather: dict[dist.ProcessGroup, AllGatherInto] = field(default_factory=dict)

    def _count(self, name: str, nbytes: int) -> None:
        self.bytes_sent[name] = self.bytes_sent.get(name, 0) + nbytes
        self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())

    def all_gather(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                   dim: int = 0) -> torch.Tensor:
        """Concatenate equal-shaped tensors of all ranks along ``dim`` (rank-major)."""
        shm = self.shm_all_gather.get(group) if group is not None else None
        if shm is not None and tensor.dtype in SHM_DTYPES:
            world, tensor = group_size(group), tensor.contiguous()
            out = torch.empty((world * tensor.shape[0],) + tensor.shape[1:], dtype=tensor.dtype,
                              device=tensor.device)
            self._count("all_gather", tensor.numel() * tensor.element_size() * (world - 1))
            shm(tensor, out)
        else:
            out, work = self.all_gather_async(tensor, group)
            if work is None:
                return out
            work.wait()
        if dim != 0:
            out = torch.cat(out.chunk(group_size(group), dim=0), dim=dim)
        return out

    def all_gather_async(self, tensor: torch.Tensor, group: dist.ProcessGroup | None
                         ) -> tuple[torch.Tensor, "dist.Work | None"]:
        """Start a rank-major all-gather along dim 0; returns (output, work to wait on).

        The output must not be read before ``work.wait()`` (work is None for one rank).
        """
        world = group_size(group)
        if world == 1:
            return tensor, None
        tensor = tensor.contiguous()
        out = torch.empty((world * tensor.shape[0],) + tensor.shape[1:], dtype=tensor.dtype,
                          device=tensor.device)
        self._count("all_gather", tensor.numel() * tensor.element_size() * (world - 1))
        return out, _all_gather_tensor(out, tensor, group=group, async_op=True)

    def reduce_scatter(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                       dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/world slice along ``dim``."""
        world = group_size(group)
        if world == 1:
            return tensor
        if tensor.shape[dim] % world:
            raise ValueError(f"reduce_scatter: dim {dim} of size {tensor.shape[dim]} is not "
                             f"divisible by the group size {world}")
        parts = torch.cat(tensor.chunk(world, dim=dim), dim=0).contiguous() if dim else tensor.contiguous()
        nbytes = parts.numel() * parts.element_size()
        if str(dist.get_backend(group)) not in self.reduce_scatter_backends:
            self._count("all_reduce", nbytes * 2 * (world - 1) // world)
            dist.all_reduce(parts, group=group)
            return parts.chunk(world, dim=0)[group_rank(group)].clone()
        out = torch.empty((parts.shape[0] // world,) + parts.shape[1:], dtype=parts.dtype,
                          device=parts.device)
        self._count("reduce_scatter", nbytes * (world - 1) // world)
        _reduce_scatter_tensor(out, parts, group=group)
        return out

    def all_to_all(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """tensor: [world, ...]; row j goes to rank j. Returns [world, ...]: row i from rank i."""
        world = group_size(group)
        if world == 1:
            return tensor
        if tensor.shape[0] != world:
            raise ValueError(f"all_to_all: leading dim {tensor.shape[0]} != group size {world}")
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        self._count("all_to_all", tensor.numel() * tensor.element_size() * (world - 1) // world)
        dist.all_to_all_single(out, tensor, group=group)
        return out
