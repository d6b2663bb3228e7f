"""The lm_head split over the PCP group: each rank projects onto its share of the vocabulary.

Every PCP rank computes the logits of the same rows: the sampled rows are restored on every
rank, and decode rows run on every rank. Left whole, the lm_head ``[vocab, hidden]`` is the
largest matmul a decode step repeats on each rank (SmolLM2: 49152 x 576, 113 MB of fp32 read
per step). Split, rank ``r`` multiplies by rows ``vocab_share(vocab, world, r)`` of the weight
and one all-gather over the PCP group (vLLM CPU's shared memory where it has it) puts the
columns back in vocab order. Each logit is the same dot product of the same hidden row and
weight row, so only the GEMM's blocking over the vocab differs: with vLLM's oneDNN GEMM on one
thread per rank (as vLLM binds PCP workers) the fp32 and bf16 logits of SmolLM2's head are
bitwise those of the whole head (tests/vllm_e2e/test_logits_split.py).

The split applies where vLLM left a plain head: tp = 1, unquantized weight and a CPU GEMM
installed by vLLM (``layer.cpu_linear``); elsewhere the head stays whole and the log says why
(LoRA and speculative decoding with a draft model, which would bring other heads, are refused
with pcp > 1 at start-up: :mod:`.config_hook`; ngram speculation has no head of its own). ``CP_ATTENTION_VLLM_SPLIT_LM_HEAD=0`` keeps it whole.

Private vLLM names relied on (vLLM 0.32.0): ``ParallelLMHead.cpu_linear`` (set by
``dispatch_cpu_unquantized_gemm``, ``vllm/model_executor/layers/utils.py:470``) and its call
``layer.cpu_linear(x, weight, bias)`` (``cpu_unquantized_gemm``, same file, ``:611``).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                 UnquantizedEmbeddingMethod)

from cp_attention import envs
from cp_attention.integrations.vllm import LOGGER_NAME
from cp_attention.mathutils import ceil_div

log = logging.getLogger(LOGGER_NAME)
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def vocab_share(vocab: int, world: int, rank: int) -> slice:
    """Rank ``rank``'s rows of a ``vocab``-row head: equal widths of ``ceil_div(vocab, world)``,
    the last share shorter (or empty) where ``world`` does not divide ``vocab``."""
    width = ceil_div(vocab, world)
    return slice(min(rank * width, vocab), min((rank + 1) * width, vocab))


class VocabSplitLinear:
    """``cpu_linear(x, weight, bias)`` of a head whose rows are split over ``world`` ranks.

    weight [vocab, hidden] (the whole head's); make_linear(weight share) -> the GEMM for that
    share; all_gather([M, width]) -> [M, world * width], the ranks' columns in rank order
    (``Communicator.all_gather(..., dim=1)``). A call: x [..., hidden], bias [vocab] or None ->
    logits [..., vocab].
    """

    def __init__(self, weight: torch.Tensor, rank: int, world: int,
                 make_linear: Callable[[torch.Tensor], Linear],
                 all_gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.vocab = weight.shape[0]
        self.width = ceil_div(self.vocab, world)
        self.share = vocab_share(self.vocab, world, rank)
        self.weight = weight[self.share]
        self.linear = make_linear(self.weight)
        self.all_gather = all_gather

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., hidden] -> [..., vocab]; ``weight`` (vLLM's whole head) is not read: the
        share's rows were taken at construction; ``bias`` is the whole head's."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:  # the same on every rank (same batch): no collective
            return x.new_zeros(*x.shape[:-1], self.vocab)
        part = self.linear(rows, self.weight, None if bias is None else bias[self.share])
        if part.shape[-1] < self.width:  # the last share of an uneven split
            part = torch.nn.functional.pad(part, (0, self.width - part.shape[-1]))
        logits = self.all_gather(part.contiguous())[:, :self.vocab]  # [M, vocab]
        return logits.reshape(*x.shape[:-1], self.vocab)


def _vllm_cpu_linear(weight: torch.Tensor) -> Linear:
    """The CPU GEMM vLLM itself picks for a head of this weight (oneDNN, sgl or torch)."""
    holder = nn.Module()
    holder.weight = nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    return holder.cpu_linear


def why_not_split(lm_head: nn.Module | None, world: int) -> str | None:
    """Why the head stays whole, or None where :func:`split_lm_head` applies."""
    if world == 1:
        return "one PCP rank"
    if not envs.CP_ATTENTION_VLLM_SPLIT_LM_HEAD:
        return "CP_ATTENTION_VLLM_SPLIT_LM_HEAD=0"
    if not isinstance(lm_head, ParallelLMHead):
        return f"no vLLM ParallelLMHead at model.lm_head ({type(lm_head).__name__})"
    if lm_head.tp_size != 1:
        return f"tensor parallel {lm_head.tp_size} already splits it"
    if not isinstance(lm_head.quant_method, UnquantizedEmbeddingMethod):
        return f"quantized ({type(lm_head.quant_method).__name__})"
    if not hasattr(lm_head, "cpu_linear") or lm_head.weight.device.type != "cpu":
        return "no vLLM CPU GEMM on it"
    vocab = lm_head.weight.shape[0]
    last = vocab_share(vocab, world, world - 1)
    if last.start == last.stop:
        return f"{vocab} vocab rows leave PCP rank {world - 1} none"
    return None


def split_lm_head(model: nn.Module, rank: int, world: int,
                  all_gather: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Make ``model.lm_head`` compute its vocab share on this PCP rank (collective at every
    logits call); returns whether it did, logging either way."""
    lm_head = getattr(model, "lm_head", None)
    reason = why_not_split(lm_head, world)
    if reason is not None:
        log.info("cp_attention lm_head: whole on every PCP rank (%s)", reason)
        return False
    split = VocabSplitLinear(lm_head.weight.data, rank, world, _vllm_cpu_linear, all_gather)
    lm_head.cpu_linear = split
    log.info("cp_attention lm_head: vocab rows %d:%d of %d on PCP rank %d/%d (all-gathered)",
             split.share.start, split.share.stop, split.vocab, rank, world)
    return True
