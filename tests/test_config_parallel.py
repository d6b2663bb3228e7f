"""CPConfig validation, rank coordinates and the process groups / collectives over gloo."""
from __future__ import annotations

import pytest
import torch

from cp_attention import CPConfig, CPRanks, comm, heads_of_rank
from cp_attention.parallel import backend_for_device


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(pcp_size=0), "pcp_size must be an integer >= 1"),
    (dict(dcp_size=-1), "dcp_size must be an integer >= 1"),
    (dict(tp_size=2.0), "tp_size must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(tp_size=3, dcp_size=2), r"tp_size \(3\) must be divisible by dcp_size \(2\)"),
    (dict(block_size=16, cp_kv_interleave_size=3), r"block_size \(16\) must be a multiple of cp_kv_interleave_size \(3\)"),
    (dict(kv_shard="tp"), "kv_shard must be one of"),
    (dict(decode_threshold=0), "decode_threshold must be an integer >= 1"),
])
def test_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        CPConfig(**kwargs)


@pytest.mark.parametrize("cfg, heads, kv_heads, fragment", [
    (CPConfig(tp_size=2), 3, 1, r"num_heads \(3\) must be divisible by tp_size"),
    (CPConfig(), 6, 4, r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    (CPConfig(tp_size=4), 8, 6, r"num_heads \(8\) must be a multiple of num_kv_heads \(6\)"),
    (CPConfig(tp_size=2, dcp_size=2), 4, 4, "must be >= dcp_size"),
    (CPConfig(tp_size=4, dcp_size=2), 8, 4, "must be >= dcp_size"),
    (CPConfig(tp_size=8, dcp_size=4), 8, 4, r"= 2 must be >= dcp_size"),
])
def test_validate_heads(cfg, heads, kv_heads, fragment):
    with pytest.raises(ValueError, match=fragment):
        cfg.validate_heads(heads, kv_heads)


def test_valid_configs_and_properties():
    cfg = CPConfig(pcp_size=2, tp_size=4, dcp_size=2, block_size=32, cp_kv_interleave_size=16)
    cfg.validate_heads(16, 1)
    cfg.validate_heads(16, 2)
    assert cfg.world_size == 8 and cfg.cp_world == 4 and cfg.kv_world == 4 and cfg.uses_cp
    assert CPConfig(pcp_size=2, tp_size=2, dcp_size=2, kv_shard="dcp").kv_world == 2
    assert [cfg.kv_rank(p, d) for p in range(2) for d in range(2)] == [0, 1, 2, 3]
    assert CPRanks.of(cfg, 6) == CPRanks(pcp_rank=1, tp_rank=2, dcp_rank=0)
    with pytest.raises(ValueError, match="rank"):
        CPRanks.of(cfg, 8)


def test_heads_of_rank():
    assert heads_of_rank(8, 8, 2, 1) == (range(4, 8), range(4, 8))
    assert heads_of_rank(8, 2, 4, 3) == (range(6, 8), range(1, 2))
    assert heads_of_rank(8, 1, 4, 2) == (range(4, 6), range(0, 1))


def test_backend_by_device():
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device("cuda") == "nccl"
    with pytest.raises(ValueError, match="no collective backend"):
        backend_for_device("meta")


@pytest.mark.distributed
@pytest.mark.parametrize("cfg", [CPConfig(pcp_size=2, tp_size=2, dcp_size=2),
                                 CPConfig(pcp_size=2, tp_size=2, dcp_size=1),
                                 CPConfig(pcp_size=2, tp_size=2, dcp_size=2, kv_shard="dcp")],
                         ids=["pcp2tp2dcp2", "pcp2tp2", "pcp2tp2dcp2-dcpshard"])
def test_groups_and_collectives(pools, cfg):
    results = pools(4).run("cp_attention.testing.comm_tasks.collectives_task", cfg)
    for rank, seen in enumerate(results):
        pcp_rank, tp_rank = divmod(rank, 2)
        assert seen["ranks"] == CPRanks.of(cfg, rank)
        assert seen["pcp_group"]["members"] == [tp_rank, 2 + tp_rank]
        assert seen["tp_group"]["members"] == [2 * pcp_rank, 2 * pcp_rank + 1]
        expected_dcp = [2 * pcp_rank, 2 * pcp_rank + 1] if cfg.dcp_size == 2 else [rank]
        assert seen["dcp_group"]["members"] == expected_dcp
        if cfg.kv_shard == "cp":
            expected_kv = [0, 1, 2, 3] if cfg.dcp_size == 2 else [tp_rank, 2 + tp_rank]
        else:
            expected_kv = expected_dcp
        assert seen["kv_group"]["members"] == expected_kv
        for name in ("pcp_group", "dcp_group", "kv_group", "tp_group"):
            info = seen[name]
            size, me, members = info["size"], info["me"], info["members"]
            assert info["gathered"] == [float(m) for m in members for _ in range(2)]
            assert info["gathered_dim1_shape"] == (2, 3 * size)
            factor = sum(m + 1 for m in members)
            full = [[float(2 * i + j) * factor for j in range(2)] for i in range(2 * size)]
            assert info["summed"] == full[2 * me:2 * me + 2]
            assert info["summed_fallback"] == full[2 * me:2 * me + 2]
            assert info["summed_dim1"] == [[float(factor)] * 2] * 3
            assert info["a2a"] == [float(me + 100 * m) for m in members]


def test_reduce_scatter_failure_propagates(monkeypatch):
    """A failing reduce-scatter (e.g. a dead peer's timeout) raises; no second collective runs."""
    started = []

    def failing_reduce_scatter(out, parts, group=None):
        started.append("reduce_scatter")
        raise RuntimeError("Timed out waiting 4000ms for recv operation to complete")

    monkeypatch.setattr(comm, "group_size", lambda group: 2)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group: "gloo")
    monkeypatch.setattr(comm, "_reduce_scatter_tensor", failing_reduce_scatter)
    monkeypatch.setattr(comm.dist, "all_reduce", lambda *a, **k: started.append("all_reduce"))
    with pytest.raises(RuntimeError, match="Timed out"):
        comm.Communicator().reduce_scatter(torch.ones(4, 2), object())
    assert started == ["reduce_scatter"]
    monkeypatch.setattr(comm.dist, "get_backend", lambda group: "mpi")  # no tensor reduce-scatter
    monkeypatch.setattr(comm, "group_rank", lambda group: 1)
    out = comm.Communicator().reduce_scatter(torch.arange(8.0).view(4, 2), object())
    assert started == ["reduce_scatter", "all_reduce"] and out.tolist() == [[4.0, 5.0], [6.0, 7.0]]


@pytest.mark.distributed
def test_same_host_all_gather_takes_floating_all_gathers(pools):
    """Communicator.shm_all_gather: blocking all-gathers of floating tensors over the group run
    the given same-host all-gather (the vLLM integration's shared memory one), rank-major and
    along any dim; integer tensors and other groups keep the backend."""
    results = pools(4).run("cp_attention.testing.comm_tasks.shm_dispatch_task",
                           CPConfig(pcp_size=2, tp_size=2))
    for rank, seen in enumerate(results):
        members = [rank % 2, 2 + rank % 2]  # the PCP group of this rank
        rows = [[float(i * 3 + j + 10 * m) for j in range(3)] for m in members for i in range(2)]
        assert seen["f32"] == rows and seen["ints"] == rows
        assert seen["bf16"] == [rows[i] + rows[2 + i] for i in range(2)]  # dim=1
        assert seen["used"] == ["torch.float32", "torch.bfloat16"]
        assert seen["bytes"] == {"all_gather": 24 + 12 + 48}  # (w-1) x input, each call
