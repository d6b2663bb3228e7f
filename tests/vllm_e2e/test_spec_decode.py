"""ngram speculative decoding under PCP (issue 37, first slice): exact against no speculation.

SmolLM2-135M-Instruct (``real_model.prepare()``), fp32, greedy, 48 tokens, two prompts that
invite copying (a paragraph to repeat word for word, 340 tokens; the tail of a ship's log to
repeat, 1,352 tokens), so ngram drafts (3 speculative tokens, lookup 2..4) get accepted. Each
configuration is one ``run_llm.py`` subprocess:

* ``cpu_attn``: vLLM's CPU_ATTN, pcp=1, no speculation (the reference);
* ``pcp2_ngram`` / ``pcp2_dcp2_ngram``: the plugin at pcp=2 (and pcp=2 dcp=2, KV over the PCP
  ranks) with ngram speculation, the token check on (every rank compares what it sampled,
  accepted drafts included). The same engines without speculation equal CPU_ATTN in
  ``test_real_model.py`` and ``test_e2e_pcp.py``; they are not run again here (CI time).

Every configuration's tokens equal the reference's, and vLLM's own counters
(``vllm:spec_decode_num_accepted_tokens`` via ``LLM.get_metrics()``) show drafts accepted.
Negative controls (``faults/sitecustomize.py``): PCP rank 1's rejection sampler drops one
accepted token (the token check must raise); the runner restores only each request's last
hidden row, as it did before speculation ran under PCP (the tokens must change).
"""
from __future__ import annotations

import json

import pytest

from harness import CP, MULTI_WORKER, RunSpec, Runs, tokens  # sibling modules
from real_model import BREAD, LIGHTHOUSE, chat_ids, chat_tokenizer, prepare, ship_log

pytestmark = pytest.mark.vllm

MAX_TOKENS = 48
NGRAM = ("--ngram", "3,4,2")  # num_speculative_tokens, prompt_lookup_max, prompt_lookup_min
CHECK = {"CP_ATTENTION_VLLM_CHECK_TOKENS": "1"}
PCP2 = {**CP, **MULTI_WORKER}
RUNS = {
    "cpu_attn": RunSpec({}, ()),
    "pcp2_ngram": RunSpec({**PCP2, **CHECK}, ("--pcp", "2") + NGRAM),
    "pcp2_dcp2_ngram": RunSpec({**PCP2, **CHECK}, ("--pcp", "2", "--dcp", "2") + NGRAM),
    # negative controls
    "pcp2_ngram_shorten_accepted": RunSpec({**PCP2, **CHECK}, ("--pcp", "2") + NGRAM,
                                           fails=True, fault="spec_shorten_accepted"),
    "pcp2_ngram_last_rows_only": RunSpec(PCP2, ("--pcp", "2") + NGRAM,
                                         fault="spec_restore_last_rows_only"),
}
EXACT = ["pcp2_ngram", "pcp2_dcp2_ngram"]


def copy_prompts(model) -> list[list[int]]:
    tokenizer = chat_tokenizer(model)
    return [chat_ids(tokenizer, f"{LIGHTHOUSE}\n\n{BREAD}\n\nRepeat the first paragraph above "
                                "word for word."),
            chat_ids(tokenizer, f"Here is a ship's log.\n\n{ship_log(30, seed=5)}\n\nCopy the "
                                "last three days of the log exactly as written.")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("vllm_spec")
    model = prepare()
    prompts = copy_prompts(model)
    print(f"\n[spec decode] prompt tokens {[len(p) for p in prompts]}")
    (root / "prompts.json").write_text(json.dumps(prompts))
    common = ["--block-size", "32", "--max-num-seqs", "4", "--max-batched", "4096",
              "--max-model-len", "2048", "--max-tokens", str(MAX_TOKENS), "--logprobs", "1",
              "--dtype", "float32", "--prompts", "@prompts.json"]
    return Runs({"default": model}, root, RUNS, common)


def _accepted(result: dict) -> tuple[float, float]:
    spec = result["spec"]
    return spec["vllm:spec_decode_num_accepted_tokens"], spec["vllm:spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("name", EXACT)
def test_tokens_identical_to_cpu_attn(runs, name):
    ref, ours = runs.get("cpu_attn"), runs.get(name)
    assert [len(t) for t in tokens(ref)] == [MAX_TOKENS] * 2
    assert tokens(ours) == tokens(ref)
    accepted, drafted = _accepted(ours)
    print(f"{name}: {accepted:.0f} of {drafted:.0f} draft tokens accepted, generate "
          f"{ours['generate_s']} s")
    assert accepted >= MAX_TOKENS // 4, ours["spec"]  # speculation really ran and helped


@pytest.mark.parametrize("name", EXACT)
def test_plugin_and_token_check_ran(runs, name):
    log = runs.log(name)
    for rank in (0, 1):
        assert f"cp_attention PCP model runner: pcp rank {rank}/2, token check on" in log
    assert "PCPTokenMismatch" not in log


def test_corrupted_accepted_length_is_caught(runs):
    log = runs.log("pcp2_ngram_shorten_accepted")
    assert "test fault spec_shorten_accepted" in log
    assert "PCPTokenMismatch" in log


def test_draft_rows_need_their_hidden_states(runs):
    ref, faulty = runs.get("cpu_attn"), runs.get("pcp2_ngram_last_rows_only")
    assert "test fault spec_restore_last_rows_only" in runs.log("pcp2_ngram_last_rows_only")
    assert tokens(faulty) != tokens(ref)
