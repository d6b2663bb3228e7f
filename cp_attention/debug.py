"""Debug aids for long multi-rank runs: step consistency across ranks, collective timeouts.

Every rank of a CP group must plan the same :class:`StepSpec`; a rank that got another step
computes garbage or deadlocks in a collective of a different size. ``assert_step_consistent``
all-gathers a cheap checksum and names the ranks that disagree, and which field differs.
"""
from __future__ import annotations

import hashlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from cp_attention.comm import Communicator
from cp_attention.errors import StepMismatchError
from cp_attention.metadata.common import StepSpec

FIELDS = ("num_computed_tokens", "num_scheduled_tokens", "block_table")


def _digest(data: bytes) -> int:
    """A 63-bit deterministic hash (fits int64)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def step_field_checksums(step: StepSpec) -> tuple[int, int, int]:
    """Checksums of (num_computed_tokens, num_scheduled_tokens, block_table incl. its shape)."""
    table = np.ascontiguousarray(step.block_table.detach().cpu().numpy().astype(np.int64))
    shape = np.asarray(table.shape, dtype=np.int64).tobytes()
    return (_digest(step.computed.tobytes()), _digest(step.scheduled.tobytes()),
            _digest(shape + table.tobytes()))


def step_checksum(step: StepSpec) -> int:
    """One deterministic 63-bit checksum of a step (same value in every process and run)."""
    return _digest(np.asarray(step_field_checksums(step), dtype=np.int64).tobytes())


def assert_step_consistent(step: StepSpec, group: dist.ProcessGroup | None = None,
                           comm: Communicator | None = None) -> int:
    """All-gather the step checksum over ``group`` (None: the default group if initialized);
    raise :class:`StepMismatchError` naming the (global) ranks that disagree. Returns the
    checksum. Costs one all-gather of 4 int64 per rank.
    """
    if group is None:
        if not dist.is_initialized():
            return step_checksum(step)
        group = dist.group.WORLD
    comm = comm if comm is not None else Communicator()
    mine = torch.tensor([step_checksum(step), *step_field_checksums(step)], dtype=torch.int64)
    gathered = comm.all_gather(mine.unsqueeze(0), group).view(-1, 4)
    sums = gathered[:, 0].tolist()
    if len(set(sums)) == 1:
        return sums[0]
    global_ranks = dist.get_process_group_ranks(group)
    by_value: dict[int, list[int]] = {}
    for i, value in enumerate(sums):
        by_value.setdefault(value, []).append(global_ranks[i])
    majority = max(by_value, key=lambda v: (len(by_value[v]), -min(by_value[v])))
    odd = sorted(r for v, ranks in by_value.items() if v != majority for r in ranks)
    ref = sums.index(majority)
    fields = sorted({FIELDS[f] for i in range(len(sums)) for f in range(3)
                     if gathered[i, f + 1] != gathered[ref, f + 1]})
    groups_text = "; ".join(f"ranks {ranks}: {value:#x}" for value, ranks in by_value.items())
    raise StepMismatchError(f"ranks {odd} disagree with ranks {by_value[majority]} on the step "
                            f"(differing fields: {', '.join(fields)}); checksums: {groups_text}; "
                            f"this rank {dist.get_rank()} has {sums[dist.get_rank(group)]:#x}")


def set_collective_timeout(groups, timeout_s: float) -> None:
    """Apply ``timeout_s`` to every process group of a :class:`CPGroups` (and the default one).

    ``dist.new_group`` does not inherit the default group's timeout (it takes the backend
    default, 30 min for gloo), so without this a stalled rank hangs its CP peers for 30 min.
    """
    timeout = timedelta(seconds=timeout_s)
    seen = set()
    for group in (None, groups.pcp_group, groups.tp_group, groups.dcp_group, groups.kv_group):
        if group is None and not dist.is_initialized():
            continue
        key = id(group)
        if key in seen:
            continue
        seen.add(key)
        dist.distributed_c10d._set_pg_timeout(timeout, group)
