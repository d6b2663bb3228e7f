"""The lm_head split over PCP ranks (:mod:`cp_attention.integrations.vllm.logits`).

The ranks run as threads with a barrier all-gather (rank-major, like the PCP group's); the
split's logits are checked against the whole head, with vLLM's own CPU GEMM for the shares
(bitwise) and with torch's (to rounding). The split inside a real vLLM is covered by the PCP
token tests (test_e2e_pcp, test_real_model), which also check its log line.
"""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from cp_attention.integrations.vllm.logits import (VocabSplitLinear, _vllm_cpu_linear,
                                                   split_lm_head, vocab_share, why_not_split)

pytestmark = pytest.mark.vllm


def _torch_linear(weight):
    return lambda x, w, b: torch.nn.functional.linear(x, w, b)


def _run_ranks(weight, world, make_linear, x, bias=None, threads_per_rank=None):
    """Every rank's logits for x, each rank a thread; the all-gather meets at a barrier and
    joins the ranks' columns in rank order (as ``Communicator.all_gather(..., dim=1)``)."""
    parts, outs = [None] * world, [None] * world
    barrier = threading.Barrier(world)

    def rank_main(rank):
        if threads_per_rank is not None:  # OpenMP's thread count is set per calling thread
            torch.set_num_threads(threads_per_rank)

        def all_gather(part):
            parts[rank] = part
            barrier.wait()
            gathered = torch.cat(parts, dim=1)
            barrier.wait()
            return gathered
        head = VocabSplitLinear(weight, rank, world, make_linear, all_gather)
        outs[rank] = head(x, weight, bias)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(o is not None for o in outs), "a rank did not finish"
    return outs


@settings(max_examples=200, deadline=None)
@given(vocab=st.integers(1, 5000), world=st.integers(1, 8))
def test_vocab_shares_cover_the_vocab_once_in_order(vocab, world):
    rows = [i for r in range(world) for i in range(vocab)[vocab_share(vocab, world, r)]]
    assert rows == list(range(vocab))
    widths = [len(range(vocab)[vocab_share(vocab, world, r)]) for r in range(world)]
    assert max(widths) == -(-vocab // world) and widths == sorted(widths, reverse=True)


@pytest.mark.parametrize("vocab,world", [(256, 2), (257, 2), (1000, 3), (1001, 4)])
@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3)])
def test_split_logits_equal_the_whole_head(vocab, world, shape):
    gen = torch.Generator().manual_seed(vocab + world)
    weight = torch.randn(vocab, 64, generator=gen)
    bias = torch.randn(vocab, generator=gen)
    x = torch.randn(*shape, 64, generator=gen)
    for b in (None, bias):
        whole = torch.nn.functional.linear(x, weight, b)
        for logits in _run_ranks(weight, world, _torch_linear, x, b):
            assert logits.shape == (*shape, vocab)
            torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
def test_vllm_gemm_shares_are_bitwise_the_whole_head(dtype, rows):
    """SmolLM2's head shape, through vLLM's own CPU GEMM for the whole head and the shares,
    one thread per rank (as vLLM's CPU workers are bound under PCP)."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(49152, 576, generator=gen).to(dtype)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    gemm_lock = threading.Lock()  # ranks are processes in vLLM: one GEMM at a time here

    def locked_linear(share):
        linear = _vllm_cpu_linear(share)

        def run(*args):
            with gemm_lock:
                return linear(*args)
        return run
    try:
        torch.set_num_threads(1)
        whole = _vllm_cpu_linear(weight)(x, weight, None)
        split = _run_ranks(weight, 2, locked_linear, x, threads_per_rank=1)
    finally:
        torch.set_num_threads(threads)
    for logits in split:
        assert torch.equal(logits, whole)


def test_no_rows_need_no_collective():
    def never(part):
        raise AssertionError("all-gather called for an empty batch")
    head = VocabSplitLinear(torch.randn(10, 4), 0, 2, _torch_linear, never)
    assert head(torch.randn(0, 4)).shape == (0, 10)


def test_heads_left_whole_say_why(monkeypatch):
    assert why_not_split(None, 1) == "one PCP rank"
    assert "no vLLM ParallelLMHead" in why_not_split(nn.Linear(4, 4), 2)
    monkeypatch.setenv("CP_ATTENTION_VLLM_SPLIT_LM_HEAD", "0")
    assert why_not_split(None, 2) == "CP_ATTENTION_VLLM_SPLIT_LM_HEAD=0"
    model = nn.Module()
    model.lm_head = nn.Linear(4, 10)
    assert split_lm_head(model, 0, 2, lambda part: part) is False
    assert isinstance(model.lm_head, nn.Linear) and not hasattr(model.lm_head, "cpu_linear")
