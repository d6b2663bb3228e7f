"""Pool tasks that exercise :mod:`cp_attention.comm` and :mod:`cp_attention.parallel`."""
from __future__ import annotations

import torch
import torch.distributed as dist

from cp_attention.comm import Communicator, group_rank, group_size
from cp_attention.config import CPConfig


def collectives_task(rank: int, get_groups, config: CPConfig) -> dict:
    """Run each collective on the pcp/dcp/kv groups; return what this rank saw."""
    groups = get_groups(config)
    comm = Communicator()
    seen = {"ranks": groups.ranks}
    for name in ("pcp_group", "dcp_group", "kv_group", "tp_group"):
        group = getattr(groups, name)
        size, me = group_size(group), group_rank(group)
        x = torch.full((2, 3), float(rank))
        gathered = comm.all_gather(x, group)
        gathered_dim1 = comm.all_gather(x, group, dim=1)
        summed = comm.reduce_scatter(torch.arange(size * 4, dtype=torch.float32).view(size * 2, 2)
                                     * (rank + 1), group)
        summed_dim1 = comm.reduce_scatter(torch.ones(3, size * 2) * (rank + 1), group, dim=1)
        # the all-reduce path taken for backends without a tensor reduce-scatter
        summed_fallback = Communicator(reduce_scatter_backends=frozenset()).reduce_scatter(
            torch.arange(size * 4, dtype=torch.float32).view(size * 2, 2) * (rank + 1), group)
        a2a = comm.all_to_all(torch.arange(size, dtype=torch.float32).view(size, 1) + 100 * rank, group)
        members = [None] * size
        if group is not None:
            dist.all_gather_object(members, rank, group=group)
        else:
            members = [rank]
        seen[name] = dict(size=size, me=me, members=members, gathered=gathered[:, 0].tolist(),
                          gathered_dim1_shape=tuple(gathered_dim1.shape), summed=summed.tolist(),
                          summed_dim1=summed_dim1.tolist(), summed_fallback=summed_fallback.tolist(),
                          a2a=a2a[:, 0].tolist())
    seen["bytes"] = dict(comm.bytes_sent)
    return seen


def shm_dispatch_task(rank: int, get_groups, config: CPConfig) -> dict:
    """A Communicator with a same-host all-gather for the PCP group (here the list form of the
    gloo all-gather, standing in for vLLM's shared memory one): which calls it takes."""
    group = get_groups(config).pcp_group
    used = []

    def list_all_gather(tensor: torch.Tensor, out: torch.Tensor) -> None:
        used.append(str(tensor.dtype))
        dist.all_gather(list(out.chunk(group_size(group))), tensor, group=group)

    comm = Communicator(shm_all_gather={group: list_all_gather})
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    return dict(f32=comm.all_gather(x, group).tolist(),
                bf16=comm.all_gather(x.bfloat16(), group, dim=1).float().tolist(),
                ints=comm.all_gather(x.long(), group).tolist(), used=used,
                bytes=dict(comm.bytes_sent))
