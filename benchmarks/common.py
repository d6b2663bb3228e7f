"""Shared helpers of the benchmarks: CLI, timing, JSON + PNG output, the torch ring-CP shim.

Every benchmark module exposes ``run(out_dir, quick=False) -> dict`` (writes
``<out_dir>/<name>.json`` and ``<out_dir>/<name>.png``) and ``main(argv)`` for the command line
``python -m benchmarks.<name> --out results/``. ``quick`` shrinks every size for smoke tests.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(description: str, argv: list[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """``--out`` and ``--quick``, plus what ``extra`` adds to the parser."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=str(REPO_ROOT / "results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


def cpu_model() -> str:
    """The CPU's model name, family and model number (from /proc/cpuinfo)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')})")


def environment() -> dict:
    """Where the numbers come from (stored in every JSON)."""
    return {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv,
    }


def write_json(out_dir: str | Path, name: str, payload: dict) -> Path:
    """Write ``payload`` (plus the environment) to ``out_dir/name.json``; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {"benchmark": name, **payload, "environment": environment()}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_jsonable) + "\n")
    return path


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value)}")


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.2):
    """A matplotlib figure with ``ncols`` axes (Agg backend, no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def series_colors(keys) -> dict:
    """One colour per series key, in the order given: pass every panel's keys at once so that
    the same series has the same colour in every panel of a figure."""
    return {key: f"C{i % 10}" for i, key in enumerate(dict.fromkeys(keys))}


def save_figure(fig, out_dir: str | Path, name: str) -> Path:
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict:
    """Wall time of ``fn()`` in seconds: median and min over ``repeats`` after ``warmup``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "repeats": repeats}


def human_tokens(n: int) -> str:
    """4096 -> '4k', 1048576 -> '1M'."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}k"
    return str(n)


# -- PyTorch's ring context parallel on CPU (forward only) -----------------------------------
_TORCH_RING_CALLS = {"forward": 0}


def enable_torch_ring_cp_on_cpu() -> dict:
    """Let ``torch.distributed.tensor.experimental.context_parallel`` run the CPU flash op.

    torch registers ring handlers only for the CUDA SDPA ops; this adds, for
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (forward only), a DTensor sharding
    strategy (replicate, or shard on batch / heads / sequence) and a handler that calls torch's
    own ``_templated_ring_attention``. Uses private torch APIs (checked with torch 2.13).
    Returns the call counter (proof that the ring path ran).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import (expand_to_full_mesh_op_strategy,
                                                     register_op_strategy)
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.distributed.tensor.placement_types import Replicate, Shard

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if op in ring.custom_ops:
        return _TORCH_RING_CALLS

    @register_op_strategy(op, schema_info=RuntimeSchemaInfo(4))
    def _strategy(op_schema):
        # 2 outputs (out, lse) + 3 inputs (q, k, v), all with the same placement
        options = [[placement] * 5 for placement in (Replicate(), Shard(0), Shard(1), Shard(2))]
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema,
                                               options, input_index=2)

    def _handler(op_call, args, kwargs):
        dispatcher = DTensor._op_dispatcher
        info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
        sharding = info.output_sharding
        if sharding is None or sharding.needs_redistribute:
            raise RuntimeError("ring attention needs q, k, v sharded on the sequence dim")
        q, k, v = info.local_args[:3]
        dropout = info.local_args[3] if len(info.local_args) > 3 else 0.0
        causal = info.local_args[4] if len(info.local_args) > 4 else False
        kw = dict(info.local_kwargs)
        if kw.get("attn_mask") is not None:
            raise NotImplementedError("attn_mask is not supported by ring attention")
        kw.pop("attn_mask", None)
        _TORCH_RING_CALLS["forward"] += 1
        local = ring._templated_ring_attention(
            info.compute_mesh.get_group(), 2, op_call, query=q, key=k, value=v,
            is_causal=causal, dropout_p=dropout, **kw)
        return dispatcher.wrap(local, sharding.output_spec)

    ring.custom_ops[op] = _handler
    return _TORCH_RING_CALLS


def token_ticks(ax, values, axis: str = "x") -> None:
    """Log-scale token axis labelled 4k, 1M, ... (no minor labels)."""
    from matplotlib.ticker import NullLocator
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xticks if axis == "x" else ax.set_yticks)(list(values), [human_tokens(v) for v in values])
    target.set_minor_locator(NullLocator())
