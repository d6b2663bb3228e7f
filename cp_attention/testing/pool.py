"""A persistent pool of local ranks on 127.0.0.1 that runs the same task on every rank.

Spawning and connecting processes costs seconds; a pool pays it once and then runs many
tasks (a task is an importable function ``fn(rank, get_groups, *args)``; ``get_groups(config)``
returns the rank's :class:`CPGroups` and ``get_groups.device`` its device). The ranks run on
the CPU over gloo by default; ``device_type="cuda"`` (nccl) or ``"npu"`` (hccl) puts rank ``i``
on device ``i``. A rank that raises or a task that exceeds its timeout fails the call with
every rank's traceback, and the pool restarts on the next call. The parent holds the
rendezvous store on a port the OS assigns while it listens, so pools started side by side
(pytest-xdist) never race for a port.
"""
from __future__ import annotations

import importlib
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_attention import envs
from cp_attention.parallel import CPGroups, backend_for_device


class GroupCache:
    """``get_groups`` of a pool task: one :class:`CPGroups` per config, on ``device``."""

    def __init__(self, device: torch.device, collective_timeout_s: float) -> None:
        self.device = device
        self.collective_timeout_s = collective_timeout_s
        self._groups: dict = {}

    def __call__(self, config) -> CPGroups:
        if config not in self._groups:
            self._groups[config] = CPGroups.create(config, self.device,
                                                   timeout_s=self.collective_timeout_s)
        return self._groups[config]


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or accelerator ``rank`` of ``device_type``."""
    return torch.device("cpu") if device_type == "cpu" else torch.device(device_type, rank)


def _worker(rank: int, world: int, port: int, inbox, outbox, collective_timeout_s: float,
            device_type: str) -> None:
    torch.set_num_threads(1)
    if device_type == "npu" and not hasattr(torch, "npu"):
        importlib.import_module("torch_npu")  # optional device package (autoload may be off)
    device = rank_device(device_type, rank)
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    timeout = timedelta(seconds=collective_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend_for_device(device), store=store, rank=rank,
                            world_size=world, timeout=timeout)
    get_groups = GroupCache(device, collective_timeout_s)

    while True:
        task = inbox.get()
        if task is None:
            break
        fn_path, args = task
        module, name = fn_path.rsplit(".", 1)
        try:
            result = getattr(importlib.import_module(module), name)(rank, get_groups, *args)
            outbox.put((rank, True, result))
        except BaseException:  # report, keep serving
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` processes serving tasks; use as a context manager or call close().

    device_type: "cpu" (gloo, the default), "cuda" or "npu" (one device per rank; the caller
    checks there are enough, e.g. with :func:`cp_attention.launch.device.choose_device`).
    """

    def __init__(self, world_size: int, collective_timeout_s: float = 60.0,
                 device_type: str = "cpu") -> None:
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.device_type = device_type
        self._procs: list = []
        self._store = None  # rendezvous server while ranks run

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.collective_timeout_s))
        port = self._store.port
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._outbox = ctx.Queue()
        with envs.overridden(OMP_NUM_THREADS="1"):  # each rank one thread, read at spawn
            self._procs = [ctx.Process(target=_worker, daemon=True,
                                       args=(r, self.world_size, port, self._inboxes[r],
                                             self._outbox, self.collective_timeout_s,
                                             self.device_type))
                           for r in range(self.world_size)]
            for proc in self._procs:
                proc.start()

    def run(self, fn_path: str, *args, timeout_s: float = 120.0) -> list:
        """Run ``fn_path(rank, get_groups, *args)`` on every rank; results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for inbox in self._inboxes:
            inbox.put((fn_path, args))
        results, errors = {}, {}
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                pending = sorted(set(range(self.world_size)) - set(results) - set(errors))
                dead = {r: self._procs[r].exitcode for r in pending
                        if not self._procs[r].is_alive()}
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = (f"exited (exit codes {dead})" if dead
                           else f"did not finish within {timeout_s} s")
                    raise TimeoutError(f"{fn_path}: ranks {sorted(dead) or pending} {why}; "
                                       f"errors: {errors}") from None
                continue
            (results if ok else errors)[rank] = value
        if errors:
            self.close()  # ranks may be stuck in a collective: restart next time
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RuntimeError(f"{fn_path} failed on ranks {sorted(errors)}:\n{detail}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                try:
                    self._inboxes[self._procs.index(proc)].put(None)
                except Exception:
                    pass
        for proc in self._procs:
            if proc.pid is None:  # never started
                continue
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        self._procs = []
        self._store = None

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
