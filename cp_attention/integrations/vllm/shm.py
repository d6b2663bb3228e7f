"""The PCP group's all-gather in shared memory (vLLM CPU's ``shm_all_gather``), for the impls
and the PCP model runner (hidden-state restore, lm_head split).

With ``pcp = dcp`` every decode layer merges its KV shards' partials over the PCP group: a few
KB per layer call, whose cost is the collective's latency. gloo takes 0.3-0.7 ms for it on one
host (two processes, this project's dev machine); vLLM CPU's shared-memory all-gather, which
vLLM itself uses only for its TP and PP groups, about 15 us. One manager per process and group,
set up by the first :func:`pcp_communicator` call (the PCP runner's construction, at the same
point on every rank, so the setup's collectives match; the layers' impls reuse it);
``CP_ATTENTION_VLLM_SHM=0`` keeps gloo. As in vLLM's own
``CpuCommunicator``, the group stays on gloo when its ranks do not agree on one shared-memory
name: a PCP group spanning vLLM nodes (``--nnodes``) has one ``VLLM_DIST_IDENT`` per node.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import GroupCoordinator, get_pcp_group

from cp_attention import envs
from cp_attention.comm import AllGatherInto, Communicator
from cp_attention.integrations.vllm import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)
# shared-memory group name -> its all-gather, None where the group's ranks disagree on the name
_MANAGERS: dict[str, AllGatherInto | None] = {}


def impl_communicator(pcp_size: int) -> Communicator:
    """The layer impls' communicator: :func:`pcp_communicator` when PCP has two or more ranks
    (vLLM's PCP group is not read otherwise)."""
    return pcp_communicator() if pcp_size > 1 else Communicator()


def pcp_communicator() -> Communicator:
    """A :class:`Communicator` whose PCP all-gathers run in shared memory when this is vLLM's
    CPU worker (its ``_C`` ops loaded, ``VLLM_DIST_IDENT`` set) and PCP has two or more ranks;
    gloo otherwise."""
    comm = Communicator()
    if not envs.CP_ATTENTION_VLLM_SHM:
        return comm
    if not hasattr(torch.ops._C, "shm_all_gather") or envs.VLLM_DIST_IDENT is None:
        log.info("cp_attention: the PCP exchange runs on gloo (no vLLM CPU shared memory ops)")
        return comm
    group = get_pcp_group()  # read only inside a vLLM worker (VLLM_DIST_IDENT set)
    if group.world_size == 1:
        return comm
    gather = shm_all_gather(group)
    if gather is not None:
        comm.shm_all_gather[group.cpu_group] = gather
    return comm


def shm_all_gather(group: GroupCoordinator) -> AllGatherInto | None:
    """The shared-memory all-gather of ``group``, or None where its ranks do not share one
    shared-memory name (made once per process; collective)."""
    ranks = "-".join(map(str, group.ranks))
    name = f"{envs.VLLM_DIST_IDENT}-cp_attention-pcp-[{ranks}]-cpushm"
    if name not in _MANAGERS:
        names: list[str] = [""] * group.world_size
        dist.all_gather_object(names, name, group=group.cpu_group)
        if len(set(names)) > 1:
            log.info("cp_attention: the PCP exchange runs on gloo (its ranks are on %d vLLM "
                     "nodes: no one shared-memory name)", len(set(names)))
            _MANAGERS[name] = None
            return None
        threads = torch.tensor([torch.get_num_threads()], dtype=torch.int64)
        dist.all_reduce(threads, op=dist.ReduceOp.MIN, group=group.cpu_group)
        handle = torch.ops._C.init_shm_manager(name, group.world_size, group.rank_in_group,
                                               int(threads))
        dist.barrier(group.cpu_group)
        torch.ops._C.join_shm_manager(handle, name)
        dist.barrier(group.cpu_group)
        _MANAGERS[name] = functools.partial(torch.ops._C.shm_all_gather, handle)
        log.info("cp_attention: PCP all-gather in shared memory (%s)", name)
    return _MANAGERS[name]
