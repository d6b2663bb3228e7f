"""A bounded load generator for vLLM's OpenAI server: concurrent streaming completions with
cancellations and invalid requests, per-request timings, and the summary figures.

Each valid request streams a greedy completion of token-id prompt ``prompt`` (tokens read from
the chunks' logprob entries, as ids) and records the arrival time of every chunk: TTFT = first chunk - send, TPOT = (last - first) / (tokens - 1).
A cancelled request closes its stream after ``cancel_after`` chunks (the server aborts it).
An invalid request must be answered by an HTTP 4xx.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Request:
    """One request of the load: a valid greedy prompt, or an invalid one (``invalid`` set to the
    keyword arguments that make it invalid)."""

    index: int
    prompt: list[int]
    max_tokens: int
    cancel_after: int | None = None  # close the stream after this many chunks
    invalid: dict | None = None


@dataclass
class Outcome:
    index: int
    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds after sending
    status: int | None = None  # HTTP status of an error, None when the stream completed
    error: str = ""
    cancelled: bool = False
    finish_reason: str | None = None


def make_load(num_valid: int, min_len: int, max_len: int, max_tokens: int,
              prompt_of: Callable[[int, np.random.Generator], list[int]], cancel_every: int,
              invalid: list[dict], seed: int = 0) -> list[Request]:
    """``num_valid`` prompts with log-uniform lengths in [min_len, max_len] (the extremes
    included), each ``prompt_of(length, rng)``; every ``cancel_every``-th is cancelled after
    two chunks; the ``invalid`` requests are spread through the load."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(min_len), np.log(max_len), num_valid)).astype(int)
    lengths[0], lengths[-1] = min_len, max_len
    load = [Request(i, prompt_of(int(n), rng), max_tokens,
                    cancel_after=2 if i % cancel_every == cancel_every - 1 else None)
            for i, n in enumerate(lengths)]
    step = max(1, len(load) // (len(invalid) + 1))
    for j, bad in enumerate(invalid):
        at = (j + 1) * step + j
        load.insert(at, Request(-1 - j, bad.pop("prompt", [5, 6, 7]), bad.pop("max_tokens", 4),
                                invalid=bad))
    return load


def _send(client, model: str, req: Request) -> Outcome:
    import openai  # a vLLM dependency; imported here so the module loads without it

    out = Outcome(req.index)
    kwargs = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
              "temperature": 0.0, "stream": True, "logprobs": 1,
              "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    if req.invalid:
        kwargs.update(req.invalid)
    start = time.perf_counter()
    try:
        stream = client.completions.create(**kwargs)
        for chunk in stream:
            (choice,) = chunk.choices
            new = choice.logprobs.tokens if choice.logprobs else []
            if new:  # tokens as "token_id:<id>" (return_tokens_as_token_ids)
                out.chunk_times.append(time.perf_counter() - start)
                out.token_ids += [int(t.removeprefix("token_id:")) for t in new]
            out.finish_reason = choice.finish_reason or out.finish_reason
            if req.cancel_after is not None and len(out.chunk_times) >= req.cancel_after:
                stream.close()  # the client goes away mid-stream
                out.cancelled = True
                break
    except openai.APIStatusError as err:
        out.status, out.error = err.status_code, str(err)[:300]
    return out


def run_load(base_url: str, model: str, load: list[Request], concurrency: int,
             timeout_s: float) -> tuple[list[Outcome], float]:
    """Sends ``load`` with ``concurrency`` requests in flight; returns outcomes and wall s."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=timeout_s,
                           max_retries=0)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda r: _send(client, model, r), load))
    return outcomes, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(load: list[Request], outcomes: list[Outcome], wall_s: float) -> dict:
    """Requests/s (completed valid requests over the wall time) and p50/p99 TTFT, TPOT (ms)."""
    done = [o for r, o in zip(load, outcomes) if r.invalid is None and not o.cancelled]
    ttft = [o.chunk_times[0] * 1e3 for o in done if o.chunk_times]
    tpot = [(o.chunk_times[-1] - o.chunk_times[0]) * 1e3 / (len(o.token_ids) - 1)
            for o in done if len(o.token_ids) > 1]
    return {"requests": len(load), "completed": len(done), "wall_s": round(wall_s, 2),
            "requests_per_s": round(len(done) / wall_s, 3),
            "ttft_p50_ms": round(_pct(ttft, 50), 1), "ttft_p99_ms": round(_pct(ttft, 99), 1),
            "tpot_p50_ms": round(_pct(tpot, 50), 2), "tpot_p99_ms": round(_pct(tpot, 99), 2),
            "ttft_mean_ms": round(statistics.fmean(ttft), 1) if ttft else None}


def metric(text: str, name: str) -> float:
    """Sum of the samples of Prometheus metric ``name`` in a ``/metrics`` page."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(f"metric {name} not in /metrics")
    return total
