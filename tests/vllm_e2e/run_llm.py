"""Run offline vLLM generation and print one JSON result line per engine (in a subprocess).

Usage: python run_llm.py MODEL_DIR [--tp N] [--dcp N] [--pcp N] [--interleave I] [--block-size B]
       [--max-tokens N|JSON] [--max-num-seqs N] [--max-batched N] [--logprobs K]
       [--prompt-logprobs K] [--dtype float32|bfloat16|float32,bfloat16] [--dcp-comm-backend ag_rs|a2a]
       [--prefix-caching] [--retention-interval N|none] [--disable-hybrid-kv-cache-manager]
       [--sequential] [--ttft] [--no-eager] [--nnodes N --master-port P [--master-addr A]]
       [--ngram K,MAX,MIN] [--num-gpu-blocks none,N,...] --prompts JSON|@FILE
The attention backend is chosen by the environment (CP_ATTENTION_VLLM=1: cp_attention).
``--ngram K,MAX,MIN``: ngram speculative decoding (K speculative tokens, prompt_lookup_max MAX,
prompt_lookup_min MIN) with vLLM's stats on; the result then holds ``spec``, vLLM's
``vllm:spec_decode_*`` counters after generation (``LLM.get_metrics()``).
Each result has a ``label``: its dtype, or ``DTYPE/N blocks`` with ``--num-gpu-blocks`` (comma
list, ``none`` = vLLM's own budget: one engine per dtype and budget, in that order, stats on);
with that flag it also holds ``num_preemptions``, vLLM's ``vllm:num_preemptions`` counted
during its own generation.
With ``--nnodes N`` this process is node 0 of vLLM's multi-node launch (its engine and the first
world_size/N workers); nodes 1..N-1 run ``launch/vllm_serve.py MODEL ... --headless``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

RESULT_PREFIX = "CP_E2E_RESULT "


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", default="12", help="int, or JSON list (one per prompt)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-batched", type=int, default=256)
    p.add_argument("--logprobs", type=int, default=2)
    p.add_argument("--pcp", type=int, default=1)
    p.add_argument("--dtype", default="float32",
                   help="one dtype, or several comma-separated: one engine after the other in "
                        "this process, one result line each")
    p.add_argument("--dcp-comm-backend", default=None, choices=["ag_rs", "a2a"])
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--retention-interval", default=None,
                   help="prefix_cache_retention_interval: tokens, or 'none' (dense); vLLM's "
                        "default 0 keeps sliding-window blocks only at semantic boundaries")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true")
    p.add_argument("--sequential", action="store_true",
                   help="one generate call per prompt, in order (each starts after the last)")
    p.add_argument("--ttft", action="store_true",
                   help="vLLM's request metrics on: each request's ttft_s in the result")
    p.add_argument("--prompt-logprobs", type=int, default=None)
    p.add_argument("--no-eager", action="store_true", help="leave enforce_eager off")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--ngram", default=None, help="K,MAX,MIN: ngram speculative decoding")
    p.add_argument("--num-gpu-blocks", default=None,
                   help="KV cache blocks (num_gpu_blocks_override), a comma list with 'none' "
                        "for vLLM's own: one engine each, after each other (per dtype); a "
                        "result with a block count is labelled 'DTYPE/N blocks' and carries "
                        "vLLM's preemption count")
    p.add_argument("--prompts", required=True,
                   help="JSON list of token-id lists, or @FILE holding it (long prompts)")
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    kwargs = dict(model=a.model, load_format="safetensors", skip_tokenizer_init=True,
                  seed=0, max_model_len=a.max_model_len,
                  max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_batched,
                  block_size=a.block_size, tensor_parallel_size=a.tp,
                  enforce_eager=not a.no_eager, enable_prefix_caching=a.prefix_caching)
    if a.dcp > 1:
        kwargs.update(decode_context_parallel_size=a.dcp, cp_kv_cache_interleave_size=a.interleave)
    if a.pcp > 1:
        kwargs["prefill_context_parallel_size"] = a.pcp
    if a.ngram is not None:
        k, most, least = (int(x) for x in a.ngram.split(","))
        kwargs.update(speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                          "prompt_lookup_max": most, "prompt_lookup_min": least},
                      disable_log_stats=False)
    if a.retention_interval is not None:
        kwargs["prefix_cache_retention_interval"] = (
            None if a.retention_interval == "none" else int(a.retention_interval))
    if a.disable_hybrid_kv_cache_manager:
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if a.ttft:
        kwargs["disable_log_stats"] = False
    blocks_list = [None if b == "none" else int(b)
                   for b in (a.num_gpu_blocks or "none").split(",")]
    if a.num_gpu_blocks is not None:
        kwargs["disable_log_stats"] = False  # vLLM's counters (preemptions) need the stats
    if a.dcp_comm_backend is not None:
        kwargs["dcp_comm_backend"] = a.dcp_comm_backend
    if a.tp * a.pcp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if a.nnodes > 1:
        kwargs.update(nnodes=a.nnodes, node_rank=0, master_addr=a.master_addr,
                      master_port=a.master_port)
    text = open(a.prompts[1:]).read() if a.prompts.startswith("@") else a.prompts
    prompts = [{"prompt_token_ids": ids} for ids in json.loads(text)]
    max_tokens = json.loads(a.max_tokens)
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                             logprobs=a.logprobs, prompt_logprobs=a.prompt_logprobs)
              for n in max_tokens]
    engines = [(dtype, blocks) for dtype in a.dtype.split(",") for blocks in blocks_list]
    for i, (dtype, blocks) in enumerate(engines):
        if i:  # shut the previous engine (and its workers) down, reset vLLM's distributed state
            llm.llm_engine.engine_core.shutdown()
            llm = None
            cleanup_dist_env_and_memory()
        t0 = time.time()
        llm = LLM(**kwargs, dtype=dtype, num_gpu_blocks_override=blocks)
        t1 = time.time()
        preempted_before = (_counter(llm, "vllm:num_preemptions")  # the registry is per process
                            if a.num_gpu_blocks is not None else 0.0)
        if a.sequential:
            outputs = [out for prompt, param in zip(prompts, params)
                       for out in llm.generate([prompt], [param], use_tqdm=False)]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        t2 = time.time()
        result = {"dtype": dtype, "label": dtype if blocks is None else f"{dtype}/{blocks} blocks",
                  "init_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2),
                  "requests": [_request(out, a.logprobs, a.ttft) for out in outputs]}
        if a.ngram is not None:
            result["spec"] = {m.name: m.value for m in llm.get_metrics()
                              if m.name.startswith("vllm:spec_decode_") and hasattr(m, "value")}
        if a.num_gpu_blocks is not None:
            result["num_preemptions"] = (_counter(llm, "vllm:num_preemptions")
                                         - preempted_before)
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def _counter(llm, name: str) -> float:
    """vLLM's counter ``name`` (0 if it has none yet: stats off, or nothing counted)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def _request(out, logprobs: int, ttft: bool = False) -> dict:
    """One ``RequestOutput`` as JSON: tokens, top-``logprobs`` per step, cached tokens (and,
    with ``ttft``, vLLM's first-token latency of the request, from its arrival)."""
    comp = out.outputs[0]
    steps = []
    for token, top in zip(comp.token_ids, comp.logprobs):
        ranked = sorted(top.items(), key=lambda kv: kv[1].rank)[:logprobs]
        steps.append({"token": int(token), "logprob": float(top[token].logprob),
                      "rank": int(top[token].rank),
                      "top": [[int(t), float(lp.logprob)] for t, lp in ranked]})
    prompt_lps = None
    if out.prompt_logprobs is not None:  # first entry is None (no logprob for token 0)
        prompt_lps = [None if top is None else {str(t): float(lp.logprob) for t, lp in top.items()}
                      for top in out.prompt_logprobs]
    result = {"prompt_len": len(out.prompt_token_ids),
              "token_ids": [int(t) for t in comp.token_ids], "steps": steps,
              "num_cached_tokens": int(out.num_cached_tokens or 0), "prompt_logprobs": prompt_lps}
    if ttft:
        result["ttft_s"] = round(float(out.metrics.first_token_latency), 3)
    return result


if __name__ == "__main__":
    main()
