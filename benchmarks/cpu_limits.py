"""This core's ceilings, measured: multiply-add peak and read bandwidth by working-set size.

``bench_cpu_ops --matrix`` divides a row's arithmetic and bytes by them for a lower bound on the
row's time that no kernel can beat on this CPU (docs/performance.md section 12: is ours <= 0.8x
vLLM's kernel reachable on the row at all?). The loops are in ``cpu_limits.cpp`` (independent
FMA / vdpbf16ps chains; an 8-accumulator streaming read), built once with ``g++ -O3
-march=native`` into ``$CP_ATTENTION_CACHE/bench`` (default ``~/.cache/cp_attention``) and
called by ctypes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from cp_attention import envs

SOURCE = Path(__file__).with_name("cpu_limits.cpp")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17"]


def _cache_dir() -> Path:
    root = envs.CP_ATTENTION_CACHE
    return root / "bench"


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """The built loops (compiled on first use, keyed by source and flags)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("cpu_limits needs a C++ compiler (g++ or $CXX)")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = _cache_dir() / f"cpu_limits_{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], check=True)
        partial.replace(path)
    lib = ctypes.CDLL(str(path))
    for name in ("fp32_fma_gflops", "bf16_dot_gflops"):
        getattr(lib, name).argtypes = [ctypes.c_int64]
        getattr(lib, name).restype = ctypes.c_double
    lib.read_gbs.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.read_gbs.restype = ctypes.c_double
    return lib


def peak_gflops(repeats: int = 5, iters: int = 2_000_000) -> dict[str, float]:
    """Best of ``repeats`` multiply-add rates, GFLOP/s (2 flops per multiply-add): "float32"
    (FMA) and "bfloat16" (vdpbf16ps where the CPU has it, else the fp32 rate: bf16 operands
    are widened to fp32 FMAs)."""
    lib = _library()
    fp32 = max(lib.fp32_fma_gflops(iters) for _ in range(repeats))
    bf16 = max(lib.bf16_dot_gflops(iters) for _ in range(repeats))
    return {"float32": fp32, "bfloat16": max(bf16, fp32)}


def read_gbs(nbytes: int, seconds: float = 0.05) -> float:
    """Best read rate, GB/s, over a warm buffer of ``nbytes`` (rounded up to 512 B), passes
    adding up to about ``seconds`` at 100 GB/s (at least 5)."""
    nbytes = max(512, -(-int(nbytes) // 512) * 512)
    passes = max(5, int(seconds * 100e9 / nbytes))
    return _library().read_gbs(nbytes, passes)
