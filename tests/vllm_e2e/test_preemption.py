"""Preemption under PCP x DCP: a KV cache too small for the batch gives the unpressured tokens.

When a running request needs a KV block and none is free, vLLM preempts the newest running
request: it frees the request's blocks and later prefills it again from token 0, its
generated tokens included (vLLM 0.32 ``Scheduler._preempt_request``; a waiting request is
admitted only if its whole prompt fits, ``KVCacheManager.allocate_slots``
``full_sequence_must_fit``, so the pressure comes from decodes that cross a block boundary).

Each model runs once at pcp=2 with ``--decode-context-parallel-size 2`` (the KV of full
attention layers sharded over the two ranks: a block holds ``2 * BLOCK`` tokens of a request;
Gemma 3's sliding-window layers whole on each rank, ``BLOCK`` tokens a block) in one process
with two engines: vLLM's own KV budget, then ``--num-gpu-blocks`` = exactly two prompts' blocks
(plus vLLM's null block). ``NUM_PROMPTS`` prompts of a length that fills whole blocks of every
group are queued at once; the first two fill the pool, and the first decode step needs a new
block for each of them, so vLLM must preempt.

* SmolLM2 (30 full-attention layers): prompts of ``SMOL_LEN`` = 8 sharded blocks each;
* Gemma 3 (15 window layers in 5 groups, 3 global layers in 1): prompts of ``GEMMA_LEN`` =
  448 tokens, inside the 512 window, so no window block is freed before the pool is full
  (``GEMMA_LEN / (2 BLOCK)`` global blocks + 5 x ``GEMMA_LEN / BLOCK`` window blocks).

Asserted, from vLLM's own counter ``vllm:num_preemptions`` of each engine: the pressured engine
preempted and the unpressured one did not; the pressured tokens equal the unpressured ones (fp32,
greedy) and the logprobs agree within ``LOGPROB_TOL``.
"""
from __future__ import annotations

import json
import re

import pytest

from harness import CP, MULTI_WORKER, RunSpec, Runs, max_logprob_diff, tokens  # siblings
from real_model import GEMMA3, SMOLLM2, chat_tokenizer, plain_ids, prepare

pytestmark = pytest.mark.vllm

BLOCK = 32
DCP = 2
NUM_PROMPTS = 4
MAX_TOKENS = 16
LOGPROB_TOL = 5e-3
SMOL_LEN = 8 * DCP * BLOCK  # 512 tokens: 8 blocks of the sharded cache
GEMMA_LEN = 7 * DCP * BLOCK  # 448 tokens: 7 global (sharded) blocks, 14 per window group
GEMMA_WINDOW_GROUPS = 5  # 15 window layers in groups of 3, beside the 3 global layers
BLOCKS_PER_PROMPT = {
    "smollm2": SMOL_LEN // (DCP * BLOCK),
    "gemma3": GEMMA_LEN // (DCP * BLOCK) + GEMMA_WINDOW_GROUPS * GEMMA_LEN // BLOCK,
}
LENGTHS = {"smollm2": SMOL_LEN, "gemma3": GEMMA_LEN}
ENV = {**CP, "CP_ATTENTION_VLLM_CHECK_TOKENS": "1", **MULTI_WORKER}


def _pool(model: str) -> int:
    """Two prompts' blocks and vLLM's null block (block 0 is never handed out)."""
    return 2 * BLOCKS_PER_PROMPT[model] + 1


RUNS = {model: RunSpec(ENV, ("--pcp", "2", "--dcp", str(DCP), "--max-model-len",
                             str(LENGTHS[model] + MAX_TOKENS), "--num-gpu-blocks",
                             f"none,{_pool(model)}", "--prompts", f"@{model}.json"), model)
        for model in LENGTHS}
PRESSURED = {model: f"float32/{_pool(model)} blocks" for model in LENGTHS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("vllm_preemption")
    models = {"smollm2": prepare(SMOLLM2), "gemma3": prepare(GEMMA3)}
    for name, path in models.items():
        tokenizer = chat_tokenizer(path)
        prompts = [plain_ids(tokenizer, LENGTHS[name], seed=30 + i) for i in range(NUM_PROMPTS)]
        assert [len(p) for p in prompts] == [LENGTHS[name]] * NUM_PROMPTS
        (root / f"{name}.json").write_text(json.dumps(prompts))
    common = ["--block-size", str(BLOCK), "--max-num-seqs", str(NUM_PROMPTS),
              "--max-batched", str(NUM_PROMPTS * max(LENGTHS.values())),
              "--max-tokens", str(MAX_TOKENS), "--logprobs", "5"]
    return Runs(models, root, RUNS, common)


@pytest.mark.parametrize("model", list(RUNS))
def test_preempted_tokens_equal_unpressured(runs, model):
    calm, pressed = runs.get(model, "float32"), runs.get(model, PRESSURED[model])
    print(f"{model}: preemptions {calm['num_preemptions']:.0f} with vLLM's KV budget, "
          f"{pressed['num_preemptions']:.0f} with {_pool(model)} blocks; generate "
          f"{calm['generate_s']} s vs {pressed['generate_s']} s")
    assert calm["num_preemptions"] == 0
    assert pressed["num_preemptions"] > 0
    assert [len(t) for t in tokens(calm)] == [MAX_TOKENS] * NUM_PROMPTS
    assert tokens(pressed) == tokens(calm)
    assert max_logprob_diff(calm, pressed) <= LOGPROB_TOL


@pytest.mark.parametrize("model", list(RUNS))
def test_kv_layout_logged(runs, model):
    """Our impl and runner ran on both ranks, and the KV groups are laid out as documented:
    full attention sharded over the DCP ranks; Gemma's window layers whole on each rank."""
    log = runs.log(model)
    for rank in (0, 1):
        assert f"cp_attention PCP model runner: pcp rank {rank}/2, token check on" in log
    groups = set(re.findall(r"cp_attention KV cache group \d+: \d+ (\S+) (?:\(\d+\) )?layers, "
                            r"([^;]+);", log))
    full = ("full-attention", f"sharded over {DCP} DCP ranks")
    window = ("sliding-window", "whole on every rank (replicated over DCP)")
    assert groups == ({full, window} if model == "gemma3" else {full}), groups
    assert "PCPTokenMismatch" not in log
