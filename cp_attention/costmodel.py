"""An analytic cost model of CP attention: per-rank compute and communication time.

Scope: the attention of every layer plus, optionally, the rest of the layer (linear layers,
``ModelShape.dense_flops_per_token``) whose tokens PCP also splits. Tensor-parallel
communication is left out (the same for every (pcp, dcp) at a fixed tp). Communication is
not overlapped with compute (this is what ``cp_attention.impl.cp`` does).

Per rank and per layer (ring accounting, as :class:`cp_attention.comm.Communicator`):

* prefill of a prompt of L tokens, no cached context, ``c = ceil(L / (2 pcp))``:
  compute = ``4 Hq/tp D (2 pcp c^2 + c)`` FLOPs (head/tail chunks; ``L (L+1) / 2`` query-key
  pairs when pcp = 1), comm = one all-gather of the local K and V rows:
  ``2c * 2 Hkv_r D b * (pcp - 1)`` bytes (lower bound ``(pcp-1)/pcp * L * 2 Hkv_r D b``).
* decode of a batch of B one-token requests with context L (KV sharded over pcp*dcp ranks):
  attention reads ``B L/(pcp dcp)`` cached tokens (memory-bound), and communicates, for
  dcp > 1, an all-gather of Q heads, an all-gather of LSE (fp32) and a reduce-scatter of the
  fp32 outputs; for pcp > 1 one all-to-all of packed ``[out | lse]`` (fp32). Decode traffic
  does not grow with L.

A collective over w ranks costs ``(w - 1) * latency + bytes / link_bw`` (ring).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cp_attention.mathutils import ceil_div


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model. dense_flops_per_token: non-attention FLOPs per token
    and layer (about 2 x parameters of the layer; 0 = attention only)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int = 2
    dense_flops_per_token: float = 0.0

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads a TP rank holds (replicated when fewer than tp)."""
        return max(1, self.num_kv_heads // tp)

    def q_heads_per_rank(self, tp: int) -> int:
        return self.num_heads // tp


@dataclass(frozen=True)
class Device:
    """One accelerator and its links. flops: peak dense FLOP/s at the model dtype;
    efficiency: achieved fraction of peak in attention / GEMM kernels; link_bw: bytes/s one
    rank sends per direction; link_latency_s: cost of one ring step of a collective;
    cores: ranks that can compute at once on one host (None = every rank has its own chip)."""

    name: str
    flops: float
    hbm_bw: float
    hbm_bytes: float
    link_bw: float
    link_latency_s: float
    efficiency: float = 0.6
    cores: int | None = None
    source: str = ""


# Figures: peak dense bf16/fp16 (no sparsity), HBM bandwidth and capacity, intra-node link
# bandwidth per direction. Latency and efficiency are assumptions (see docs/performance.md).
PRESETS: dict[str, Device] = {
    "ascend-910b": Device(
        "ascend-910b", flops=320e12, hbm_bw=1.6e12, hbm_bytes=64e9, link_bw=392e9 / 2,
        link_latency_s=20e-6, efficiency=0.5,
        source="~320 TFLOP/s fp16, 64 GB HBM2e ~1.6 TB/s, HCCS 392 GB/s per chip (8-chip "
               "full mesh, Atlas 800T A2); public third-party figures, approximate"),
    "h100-sxm": Device(
        "h100-sxm", flops=989e12, hbm_bw=3.35e12, hbm_bytes=80e9, link_bw=450e9,
        link_latency_s=10e-6, efficiency=0.6,
        source="NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 80 GB HBM3 3.35 TB/s, "
               "NVLink 4 900 GB/s bidirectional (450 GB/s per direction)"),
    "h200-sxm": Device(
        "h200-sxm", flops=989e12, hbm_bw=4.8e12, hbm_bytes=141e9, link_bw=450e9,
        link_latency_s=10e-6, efficiency=0.6,
        source="NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 141 GB HBM3e 4.8 TB/s, "
               "NVLink 4 900 GB/s bidirectional"),
    # Fitted by benchmarks/bench_cost_model.py on the 2-core development machine: one thread
    # per rank running aten's CPU flash attention (fp32), gloo over loopback.
    "cpu-gloo-this-machine": Device(
        "cpu-gloo-this-machine", flops=7.9e10, hbm_bw=5e9, hbm_bytes=16e9, link_bw=2.2e8,
        link_latency_s=3.0e-4, efficiency=1.0, cores=2,
        source="fitted: single-thread fp32 CPU flash attention FLOP/s and gloo loopback "
               "all-gather latency/bandwidth (results/bench_cost_model.json)"),
}

MODELS: dict[str, ModelShape] = {
    # dense_flops_per_token ~ 2 x (parameters / layers), rounded.
    "llama3-8b": ModelShape(32, 32, 8, 128, 2, dense_flops_per_token=2 * 0.218e9),
    "llama3-70b": ModelShape(80, 64, 8, 128, 2, dense_flops_per_token=2 * 0.856e9),
    # MLA-style: one shared latent KV head of 512 + 64 (DeepSeek-V3 shape, 37B active params);
    # attention FLOPs are approximated as MHA over the latent head size.
    "mla-671b": ModelShape(61, 128, 1, 576, 2, dense_flops_per_token=2 * 37e9 / 61),
}


@dataclass(frozen=True)
class Estimate:
    """Predicted per-rank seconds for all layers, and the bytes behind them."""

    compute_s: float
    comm_s: float
    comm_bytes_per_layer: int
    kv_bytes_per_rank: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def collective_seconds(device: Device, world: int, nbytes: float) -> float:
    """Ring collective: (world - 1) latency steps plus the bytes this rank sends."""
    if world <= 1:
        return 0.0
    return (world - 1) * device.link_latency_s + nbytes / device.link_bw


def _compute_rate(device: Device, ranks_on_host: int) -> float:
    rate = device.flops * device.efficiency
    if device.cores is not None and ranks_on_host > device.cores:
        rate *= device.cores / ranks_on_host
    return rate


# -- bytes (exact, integer: what Communicator counts) ----------------------------------------
def prefill_comm_bytes(model: ModelShape, prompt: int, pcp: int, tp: int = 1,
                       dtype_bytes: int | None = None) -> int:
    """Bytes one rank sends per layer for a no-context prefill: the PCP K/V all-gather."""
    if pcp == 1:
        return 0
    b = model.dtype_bytes if dtype_bytes is None else dtype_bytes
    chunk = ceil_div(prompt, 2 * pcp)
    return 2 * chunk * 2 * model.kv_heads_per_rank(tp) * model.head_size * b * (pcp - 1)


def prefill_comm_lower_bound(model: ModelShape, prompt: int, pcp: int, tp: int = 1,
                             dtype_bytes: int | None = None) -> float:
    """(N-1)/N x the K/V bytes of the prompt (this rank's KV heads): each rank must receive
    the K/V it does not hold, and ranks send as much as they receive."""
    b = model.dtype_bytes if dtype_bytes is None else dtype_bytes
    return (pcp - 1) / pcp * prompt * 2 * model.kv_heads_per_rank(tp) * model.head_size * b


def decode_comm_bytes(model: ModelShape, batch: int, pcp: int, tp: int = 1, dcp: int = 1,
                      dtype_bytes: int | None = None) -> int:
    """Bytes one rank sends per layer for a decode-only step of ``batch`` one-token requests
    (KV sharded over pcp * dcp ranks). Independent of the context length."""
    b = model.dtype_bytes if dtype_bytes is None else dtype_bytes
    hq, d = model.q_heads_per_rank(tp), model.head_size
    total = 0
    if dcp > 1:
        total += batch * hq * d * b * (dcp - 1)  # all-gather Q heads
        total += batch * dcp * hq * 4 * (dcp - 1)  # all-gather LSE (fp32)
        total += batch * dcp * hq * d * 4 * (dcp - 1) // dcp  # reduce-scatter fp32 outputs
    if pcp > 1:
        total += pcp * batch * hq * (d + 1) * 4 * (pcp - 1) // pcp  # all-to-all [out | lse]
    return total


def decode_collectives(pcp: int, dcp: int) -> int:
    return (3 if dcp > 1 else 0) + (1 if pcp > 1 else 0)


def naive_context_gather_bytes(model: ModelShape, context: int, world: int, tp: int = 1) -> float:
    """What gathering the whole sharded context every step would send (what CP avoids)."""
    return (world - 1) / world * context * 2 * model.kv_heads_per_rank(tp) * model.head_size \
        * model.dtype_bytes


# -- time -------------------------------------------------------------------------------------
def prefill_estimate(model: ModelShape, device: Device, prompt: int, pcp: int = 1,
                     tp: int = 1, dcp: int = 1) -> Estimate:
    """Per-rank time of a no-context causal prefill of ``prompt`` tokens (all layers)."""
    chunk = ceil_div(prompt, 2 * pcp)
    pairs = 2 * pcp * chunk * chunk + chunk  # query-key pairs per rank and head
    attn = 4 * model.q_heads_per_rank(tp) * model.head_size * pairs
    dense = model.dense_flops_per_token * 2 * chunk / tp
    compute = model.num_layers * (attn + dense) / _compute_rate(device, pcp * tp)
    nbytes = prefill_comm_bytes(model, prompt, pcp, tp)
    comm = model.num_layers * collective_seconds(device, pcp, nbytes)
    kv = _kv_bytes(model, prompt, 1, pcp * dcp, tp)
    return Estimate(compute, comm, nbytes, kv)


def decode_estimate(model: ModelShape, device: Device, context: int, batch: int = 1,
                    pcp: int = 1, tp: int = 1, dcp: int = 1) -> Estimate:
    """Per-rank time of one decode step of ``batch`` requests with ``context`` cached tokens."""
    hkv, hq, d, b = (model.kv_heads_per_rank(tp), model.q_heads_per_rank(tp), model.head_size,
                     model.dtype_bytes)
    local = math.ceil(context / (pcp * dcp))
    read = batch * local * 2 * hkv * d * b
    flops = 4 * batch * local * hq * dcp * d
    rate = _compute_rate(device, pcp * tp)
    attn = max(read / device.hbm_bw, flops / rate)
    weights = model.dense_flops_per_token / 2 * b / tp  # dense decode is weight-bound
    dense = max(weights / device.hbm_bw, batch * model.dense_flops_per_token / tp / rate)
    compute = model.num_layers * (attn + dense)
    nbytes = decode_comm_bytes(model, batch, pcp, tp, dcp)
    per_layer = 0.0
    if dcp > 1:  # Q gather, LSE gather, output reduce-scatter
        q_b = batch * hq * d * b * (dcp - 1)
        lse_b = batch * dcp * hq * 4 * (dcp - 1)
        out_b = batch * dcp * hq * d * 4 * (dcp - 1) // dcp
        per_layer += sum(collective_seconds(device, dcp, x) for x in (q_b, lse_b, out_b))
    if pcp > 1:
        per_layer += collective_seconds(device, pcp,
                                        pcp * batch * hq * (d + 1) * 4 * (pcp - 1) // pcp)
    kv = _kv_bytes(model, context, batch, pcp * dcp, tp)
    return Estimate(compute, model.num_layers * per_layer, nbytes, kv)


def _kv_bytes(model: ModelShape, tokens: int, batch: int, shards: int, tp: int) -> float:
    """KV cache bytes per rank (all layers) for ``batch`` requests of ``tokens`` tokens."""
    return (model.num_layers * batch * math.ceil(tokens / shards) * 2
            * model.kv_heads_per_rank(tp) * model.head_size * model.dtype_bytes)


def prefill_efficiency(model: ModelShape, device: Device, prompt: int, pcp: int,
                       tp: int = 1) -> float:
    """Parallel efficiency of PCP prefill: t(pcp=1) / (pcp * t(pcp)) at the same tp."""
    base = prefill_estimate(model, device, prompt, 1, tp).total_s
    return base / (pcp * prefill_estimate(model, device, prompt, pcp, tp).total_s)


# -- recommendation ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mix:
    """A workload: requests of ``prompt`` tokens each followed by ``decode_steps`` decode steps
    in batches of ``decode_batch`` (average context = prompt + decode_steps / 2)."""

    prompt: int
    decode_steps: int
    decode_batch: int = 1


@dataclass(frozen=True)
class Choice:
    pcp: int
    dcp: int
    prefill_s: float
    decode_step_s: float
    request_s: float  # prefill + decode_steps x decode step
    efficiency: float  # (pcp=1, dcp=1) request time / (pcp x request time)
    kv_bytes_per_rank: float
    fits: bool


def valid_dcp(model: ModelShape, tp: int) -> list[int]:
    """dcp sizes allowed by vLLM's DCP rules at this tp (see CPConfig.validate_heads)."""
    out = []
    for dcp in range(1, tp + 1):
        if tp % dcp:
            continue
        if dcp > 1:
            replicas = tp // model.num_kv_heads
            if replicas < dcp or replicas % dcp or (model.num_heads // model.num_kv_heads) % dcp:
                continue
        out.append(dcp)
    return out


def evaluate(model: ModelShape, device: Device, mix: Mix, tp: int, pcps=(1, 2, 4, 8),
             kv_memory_fraction: float = 0.5) -> list[Choice]:
    """Every (pcp, dcp) candidate, in the order pcp then dcp."""
    context = mix.prompt + mix.decode_steps // 2
    choices = []
    for pcp in pcps:
        for dcp in valid_dcp(model, tp):
            pre = prefill_estimate(model, device, mix.prompt, pcp, tp, dcp).total_s
            dec = decode_estimate(model, device, context, mix.decode_batch, pcp, tp, dcp)
            request = pre + mix.decode_steps * dec.total_s
            kv = _kv_bytes(model, mix.prompt + mix.decode_steps, mix.decode_batch, pcp * dcp, tp)
            choices.append(Choice(pcp, dcp, pre, dec.total_s, request, 0.0, kv,
                                  kv <= kv_memory_fraction * device.hbm_bytes))
    ref = next((c.request_s for c in choices if (c.pcp, c.dcp) == (1, 1)), choices[0].request_s)
    return [replace(c, efficiency=ref / (c.pcp * c.request_s)) for c in choices]


def recommend(model: ModelShape, device: Device, mix: Mix, tp: int, pcps=(1, 2, 4, 8),
              min_efficiency: float = 0.7, kv_memory_fraction: float = 0.5) -> Choice:
    """The fastest (pcp, dcp) per request whose KV cache fits and whose efficiency is at
    least ``min_efficiency``; if none qualifies, the fastest that fits; else the one needing
    the least memory."""
    choices = evaluate(model, device, mix, tp, pcps, kv_memory_fraction)
    good = [c for c in choices if c.fits and c.efficiency >= min_efficiency]
    if good:
        return min(good, key=lambda c: (c.request_s, c.pcp, c.dcp))
    fits = [c for c in choices if c.fits]
    if fits:
        return min(fits, key=lambda c: (c.request_s, c.pcp, c.dcp))
    return min(choices, key=lambda c: (c.kv_bytes_per_rank, c.request_s))
