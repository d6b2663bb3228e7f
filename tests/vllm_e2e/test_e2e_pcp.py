"""PCP end to end in a real vLLM (CPU): cp_attention's PCP worker/runner vs vLLM's CPU_ATTN at pcp=1.

Tiny Llamas with random weights (head_dim 32): ``gqa`` with 4 query / 2 KV heads and ``g93``
with 9 query / 3 KV heads (SmolLM2's ratio), run with PCP alone (full KV on every PCP rank)
and with dcp = pcp (KV sharded over the PCP ranks, at tp=1 and tp=2), which vLLM by itself
refuses for these head counts (``vllm/config/model.py:1565``; the plugin's config hook lifts it
for this layout). Greedy, block size 32, prefix caching on, ``max_num_seqs=3``, 64 batched
tokens. Six prompts make the run contain:

* P0 = a 70-token prefix X + 2 tokens: chunked (64 + 8), finishes after 2 tokens; its blocks
  stay cached;
* P1: 6 tokens (padded to 8, chunks of 2: its last token lands on PCP rank 1);
* P2: 1 token; P3: 5 tokens (2 * pcp + 1, last token on rank 1);
* P4 = X + 3 tokens: scheduled after P0 finished, so it hits the prefix cache (64 tokens, two
  blocks; asserted from vLLM's ``num_cached_tokens``) and prefills 9 tokens over cached context;
* P5: 100 tokens, prefilled in chunks next to the other requests' decodes.

Under dcp = pcp each token is stored on exactly one PCP rank and decode rows attend only that
rank's shard: the builders' ``cp_attention KV shard`` log lines must split the stored tokens
and the decode rows' cached keys about half and half. Every PCP run has
``CP_ATTENTION_VLLM_CHECK_TOKENS=1`` (all PCP ranks sampled the same tokens every step, else
the run dies). Negative controls (injected by ``faults/sitecustomize.py``): no hidden-state
restore changes tokens; a rank reporting a wrong token makes the check fire; a runner whose
``_model_forward`` override is bypassed makes the impl refuse the step.
"""
from __future__ import annotations

import json
import re

import pytest

from harness import (CP, MULTI_WORKER, RunSpec, Runs, greedy_margins, max_logprob_diff,
                     pcp_exchange_logged, tokens)
from tiny_model import make_tiny_llama

pytestmark = pytest.mark.vllm

PREFIX = [(11 * i + 7) % 256 for i in range(70)]
PROMPTS = [
    PREFIX + [1, 2],
    [3, 4, 5, 6, 7, 8],
    [5],
    [9, 8, 7, 6, 5],
    PREFIX + [7, 8, 9],
    [(7 * i + 3) % 256 for i in range(100)],
]
MAX_TOKENS = [2, 12, 12, 12, 12, 12]
HIT_REQUEST = 4
LAST_ON_RANK1 = [1, 3, 4]  # last prompt token on PCP rank 1 (head/tail chunks of 2, 2, 3)
LOGPROB_TOL = 1e-3
MIN_MARGIN = 5e-3
MARGIN_OVER_DIFF = 10.0

CHECK = {"CP_ATTENTION_VLLM_CHECK_TOKENS": "1"}
PCP2 = ("--pcp", "2")
DCP2 = ("--dcp", "2")
BOTH = ("--dtype", "float32,bfloat16")  # one engine per dtype, in one process
PROMPT_LOGPROBS = ("--prompt-logprobs", "2")
RUNS = {
    "gqa_cpu_attn": RunSpec({}, BOTH),
    "gqa_pcp2": RunSpec({**CP, **CHECK, **MULTI_WORKER}, PCP2 + BOTH),
    "gqa_cpu_attn_plp": RunSpec({}, PROMPT_LOGPROBS),
    "gqa_pcp2_plp": RunSpec({**CP, **CHECK, **MULTI_WORKER}, PCP2 + PROMPT_LOGPROBS),
    "gqa_pcp2_no_restore": RunSpec({**CP, **MULTI_WORKER}, PCP2, fault="skip_hidden_restore"),
    "gqa_pcp2_bad_rank": RunSpec({**CP, **CHECK, **MULTI_WORKER}, PCP2, fails=True,
                                 fault="perturb_tokens"),
    "gqa_pcp2_runner_bypassed": RunSpec({**CP, **MULTI_WORKER}, PCP2, fails=True,
                                        fault="runner_skips_model_forward"),
    "gqa_pcp2_dcp2": RunSpec({**CP, **CHECK, **MULTI_WORKER}, PCP2 + DCP2),
    "gqa_pcp2_tp2_dcp2": RunSpec({**CP, **CHECK, **MULTI_WORKER}, PCP2 + DCP2 + ("--tp", "2")),
    "g93_cpu_attn": RunSpec(model="g93"),
    "g93_pcp2_dcp2": RunSpec({**CP, **CHECK, **MULTI_WORKER}, PCP2 + DCP2, model="g93"),
}
PAIRS = [("gqa_cpu_attn", "gqa_pcp2"), ("gqa_cpu_attn", "gqa_pcp2_dcp2"),
         ("gqa_cpu_attn", "gqa_pcp2_tp2_dcp2"), ("g93_cpu_attn", "g93_pcp2_dcp2")]
KV_SHARD_LINE = re.compile(r"cp_attention KV shard (\d+)/(\d+): stored (\d+) of (\d+) new tokens, "
                           r"decode rows attended (\d+) of (\d+) cached keys \((\d+) steps\)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("vllm_e2e_pcp")
    models = {"default": make_tiny_llama(root / "gqa", num_kv_heads=2),
              "g93": make_tiny_llama(root / "g93", seed=3, num_attention_heads=9,
                                     num_kv_heads=3, hidden_size=144)}  # seed: margins >= 0.05
    common = ["--block-size", "32", "--max-num-seqs", "3", "--max-batched", "64",
              "--logprobs", "2", "--prefix-caching", "--max-tokens", json.dumps(MAX_TOKENS),
              "--prompts", json.dumps(PROMPTS)]
    return Runs(models, root, RUNS, common)


@pytest.mark.parametrize("ref, ours", PAIRS)
def test_pcp_tokens_identical_and_logprobs_close(runs, ref, ours):
    a, b = runs.get(ref), runs.get(ours)
    assert [len(t) for t in tokens(a)] == MAX_TOKENS
    assert tokens(b) == tokens(a)
    diff = max_logprob_diff(a, b)
    margins = greedy_margins(a)
    print(f"{ours} vs {ref}: max |logprob diff| {diff:.2e}, min greedy margin {min(margins):.4f}")
    assert diff <= LOGPROB_TOL
    assert all(s["rank"] == 1 for r in a["requests"] for s in r["steps"])
    assert min(margins) >= MIN_MARGIN and min(margins) >= MARGIN_OVER_DIFF * diff


def test_prompt_logprobs_at_pcp2(runs):
    """Prompt logprobs read every prompt token's hidden state: the runner restores all rows
    (not only the sampled ones) and the split lm_head projects each of them."""
    a, b = runs.get("gqa_cpu_attn_plp"), runs.get("gqa_pcp2_plp")
    assert tokens(b) == tokens(a)
    diff, compared = 0.0, 0
    for prompt, ra, rb in zip(PROMPTS, a["requests"], b["requests"]):
        pa, pb = ra["prompt_logprobs"], rb["prompt_logprobs"]
        assert pa is not None and pb is not None and len(pa) == len(pb) == len(prompt)
        assert pa[0] is None and pb[0] is None  # no logprob for the first token
        for token, top_a, top_b in zip(prompt[1:], pa[1:], pb[1:]):
            assert str(token) in top_a and str(token) in top_b
            for key in top_a.keys() & top_b.keys():
                diff = max(diff, abs(top_a[key] - top_b[key]))
                compared += 1
    print(f"prompt logprobs: {compared} compared, max |diff| {diff:.2e}")
    assert compared >= sum(len(p) - 1 for p in PROMPTS) and diff <= LOGPROB_TOL
    assert re.search(r"cp_attention hidden restore: step \d+, (\d+) wanted rows of \1 tokens",
                     runs.log("gqa_pcp2_plp"))  # every row restored in some step


@pytest.mark.parametrize("ref, ours", PAIRS)
def test_prefix_cache_really_hit(runs, ref, ours):
    for name in (ref, ours):
        cached = [r["num_cached_tokens"] for r in runs.get(name)["requests"]]
        assert cached[HIT_REQUEST] >= 64, (name, cached)


@pytest.mark.parametrize("name, impl, kv_shard", [("gqa_pcp2", "CPAttentionImpl", "dcp"),
                                                  ("gqa_pcp2_dcp2", "CPAttentionImpl", "cp"),
                                                  ("gqa_pcp2_tp2_dcp2", "CPAttentionImpl", "cp"),
                                                  ("g93_pcp2_dcp2", "CPAttentionImpl", "cp")])
def test_pcp_worker_and_backend_used(runs, name, impl, kv_shard):
    log = runs.log(name)
    assert "cp_attention PCP model runner: pcp rank 0/2, token check on" in log
    assert "cp_attention PCP model runner: pcp rank 1/2, token check on" in log
    assert f"cp_attention impl active: {impl}" in log and f"kv_shard {kv_shard}" in log
    assert "pcp rank 1/2" in log
    assert "PCPTokenMismatch" not in log
    if "tp2" in name:  # vLLM's TP already splits the head
        assert "cp_attention lm_head: whole on every PCP rank (tensor parallel 2" in log
    else:  # each PCP rank projects onto half the vocabulary
        assert "cp_attention lm_head: vocab rows 0:128 of 256 on PCP rank 0/2" in log
        assert "cp_attention lm_head: vocab rows 128:256 of 256 on PCP rank 1/2" in log
    # the PCP exchanges (decode partials, context queries): vLLM CPU's shared memory where
    # its ops exist (AVX-512 builds), gloo otherwise
    assert pcp_exchange_logged(log), log[-3000:]


def test_reference_runs_are_vllm_cpu_attn(runs):
    for name in ("gqa_cpu_attn", "g93_cpu_attn"):
        assert "cp_attention" not in runs.log(name)


def test_hidden_restore_gathers_only_sampled_rows(runs):
    """Per prefill step: bytes of the wanted rows (last token of each request) vs all rows."""
    lines = re.findall(r"cp_attention hidden restore: step (\d+), (\d+) wanted rows of (\d+) "
                       r"tokens, (\d+) bytes sent \(all (\d+) local rows: (\d+)\)",
                       runs.log("gqa_pcp2"))
    assert lines
    sizes = set()
    for step, wanted, num_tokens, sent, local_rows, all_rows in lines:
        size = int(all_rows) // (int(local_rows) * 64)  # bytes per element: fp32, then bf16
        sizes.add(size)
        assert int(all_rows) == int(local_rows) * 64 * size
        assert int(sent) == int(wanted) * (64 + 1) * size  # [wanted, hidden + flag], 1 peer
    assert sizes == {4, 2}  # the run's two engines
    total_sent = sum(int(x[3]) for x in lines)
    total_all = sum(int(x[5]) for x in lines)
    print(f"hidden restore over prefill steps: {total_sent} bytes vs {total_all} for all rows")
    assert total_sent < total_all


def test_bf16_pcp_matches_cpu_attn_bf16(runs):
    """bf16: tokens identical wherever the reference's greedy margin exceeds bf16 noise; the
    first step whose margin is below it may legitimately differ and ends that request's
    comparison. Logprobs are not bounded: bf16 logits carry 8 mantissa bits, so equal tokens
    come with logprobs that differ by an ulp of the logits (observed up to 0.43)."""
    a, b = runs.get("gqa_cpu_attn", "bfloat16"), runs.get("gqa_pcp2", "bfloat16")
    compared = 0
    for ra, rb in zip(a["requests"], b["requests"], strict=True):
        for sa, sb in zip(ra["steps"], rb["steps"]):
            if sa["top"][0][1] - sa["top"][1][1] < 0.1:
                break  # a near tie in bf16: later tokens depend on which side it fell
            assert sa["token"] == sb["token"], (ra["prompt_len"], sa, sb)
            compared += 1
    print(f"bf16: {compared} steps compared, tokens identical {tokens(a) == tokens(b)}")
    assert compared >= sum(MAX_TOKENS) // 2  # the rule above must not make the test vacuous


def test_negative_control_no_hidden_restore_changes_tokens(runs):
    ref = tokens(runs.get("gqa_cpu_attn"))
    broken = tokens(runs.get("gqa_pcp2_no_restore"))
    assert "test fault skip_hidden_restore: hidden states are NOT restored" in runs.log(
        "gqa_pcp2_no_restore")
    changed = [i for i, (x, y) in enumerate(zip(ref, broken)) if x != y]
    assert set(LAST_ON_RANK1) <= set(changed), changed


def test_impl_refuses_rows_the_pcp_runner_did_not_select(runs):
    """Handshake: with the runner's _model_forward bypassed (as if vLLM renamed it), vLLM runs
    the model on the global batch; the impl must refuse the step instead of attending it."""
    log = runs.log("gqa_pcp2_runner_bypassed")
    assert "test fault runner_skips_model_forward" in log
    assert re.search(r"PCPRowsNotSelected: PCP rank \d: the layer got \d+ rows", log), log[-3000:]


def test_token_check_fires_when_ranks_disagree(runs):
    log = runs.log("gqa_pcp2_bad_rank")
    assert re.search(r"PCPTokenMismatch: step \d+: PCP ranks 0 and 1 sampled different tokens",
                     log), log[-3000:]


def kv_shard_totals(log: str) -> dict[int, tuple[int, ...]]:
    """KV shard -> (stored, new tokens, decode keys attended, decode context) at the largest step
    count every shard logged (TP ranks of one shard log the same numbers)."""
    lines = [tuple(map(int, m)) for m in KV_SHARD_LINE.findall(log)]
    shards = {line[0] for line in lines}
    steps = max(s for s in {line[6] for line in lines}
                if all((k, s) in {(x[0], x[6]) for x in lines} for k in shards))
    return {x[0]: x[2:6] for x in lines if x[6] == steps}


@pytest.mark.parametrize("name, world", [("gqa_pcp2", 1), ("gqa_pcp2_dcp2", 2),
                                         ("gqa_pcp2_tp2_dcp2", 2), ("g93_pcp2_dcp2", 2)])
def test_kv_sharded_over_pcp_and_decode_not_replicated(runs, name, world):
    """dcp = pcp: every new token is stored on exactly one PCP rank (about half each) and the
    decode rows of a rank attend only its shard (about half of the cached keys). PCP alone:
    every rank stores and attends everything."""
    totals = kv_shard_totals(runs.log(name))
    assert sorted(totals) == list(range(world)), totals
    stored, tokens_, keys, context = (sum(t[i] for t in totals.values()) for i in range(4))
    per_shard = {k: (t[0] / t[1], t[2] / t[3]) for k, t in totals.items()}
    print(f"{name}: KV stored / attended by decode rows per shard {per_shard}")
    assert context > 0 and all(t[1] == totals[0][1] and t[3] == totals[0][3]
                               for t in totals.values())
    assert stored == totals[0][1] and keys == totals[0][3]  # each token, each key once
    for stored_frac, keys_frac in per_shard.values():
        assert abs(stored_frac - 1 / world) <= 0.1 / world, per_shard
        assert abs(keys_frac - 1 / world) <= 0.1 / world, per_shard
