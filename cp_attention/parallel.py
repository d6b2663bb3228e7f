"""Process groups of a CP deployment: pcp, tp, dcp and the KV group (``CPConfig``).

Groups are created once from the default process group (``torchrun`` environment or an
existing group); the communication backend follows the device: gloo (cpu), nccl (cuda),
hccl (npu). This is the only module that creates groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cp_attention.config import CPConfig, CPRanks

_BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def backend_for_device(device: torch.device | str) -> str:
    """The collective backend for a device type."""
    device_type = torch.device(device).type
    if device_type not in _BACKEND_BY_DEVICE:
        raise ValueError(f"no collective backend known for device type {device_type!r}")
    return _BACKEND_BY_DEVICE[device_type]


@dataclass
class CPGroups:
    """The process groups this rank belongs to (None where a group has one member)."""

    config: CPConfig
    ranks: CPRanks
    device: torch.device
    pcp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    dcp_group: dist.ProcessGroup | None = None
    kv_group: dist.ProcessGroup | None = None  # the KV group, in kv_rank order

    @classmethod
    def single(cls, config: CPConfig | None = None, device: str | torch.device = "cpu") -> "CPGroups":
        """A one-process deployment (no groups)."""
        config = config or CPConfig()
        if config.world_size != 1:
            raise ValueError(f"single() needs world_size 1, got {config.world_size}")
        return cls(config, CPRanks(), torch.device(device))

    @classmethod
    def create(cls, config: CPConfig, device: torch.device | str,
               timeout_s: float | None = None) -> "CPGroups":
        """Create all groups; initializes the default group from the environment if needed.

        device: this rank's device; its type picks the collective backend (the launchers
        choose it with :func:`cp_attention.launch.device.select_device`). Must be called by
        every rank of the world in the same order.
        """
        device = torch.device(device)
        # new_group() does not inherit the default group's timeout (gloo's default is 30 min),
        # so the same timeout is passed to every group: a dead peer fails the step, not hangs it.
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        if not dist.is_initialized():
            dist.init_process_group(backend_for_device(device), **kwargs)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != config.world_size:
            raise ValueError(f"world size {world} != pcp_size * tp_size = {config.world_size}")
        ranks = CPRanks.of(config, rank)
        pcp, tp, dcp = config.pcp_size, config.tp_size, config.dcp_size
        groups = {"pcp_group": None, "tp_group": None, "dcp_group": None, "kv_group": None}

        def make(name: str, members_list: list[list[int]]) -> None:
            for members in members_list:  # every rank creates every group, in the same order
                group = dist.new_group(members, **kwargs) if len(members) > 1 else None
                if rank in members:
                    groups[name] = group

        make("pcp_group", [[p * tp + t for p in range(pcp)] for t in range(tp)])
        make("tp_group", [[p * tp + t for t in range(tp)] for p in range(pcp)])
        make("dcp_group", [[p * tp + b * dcp + d for d in range(dcp)]
                           for p in range(pcp) for b in range(tp // dcp)])
        if config.kv_shard == "cp":
            make("kv_group", [[p * tp + b * dcp + d for p in range(pcp) for d in range(dcp)]
                              for b in range(tp // dcp)])
        else:
            groups["kv_group"] = groups["dcp_group"]
        return cls(config, ranks, device, **groups)
