"""Builds and loads the C++ CPU attention kernels (``ops/csrc/*.cpp``) once per machine.

The first call compiles every ``csrc/*.cpp`` into one extension with
``torch.utils.cpp_extension.load`` (about 1-2 minutes here; ninja + a C++17 compiler), cached in
torch's extension directory (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)
under a name that hashes the sources, the flags and the CPU's instruction set, so edited
sources or another machine never load a stale binary. Processes starting at once share one
build (cpp_extension's file lock; a lock older than :data:`STALE_LOCK_S`, left by a process
killed while building, is removed with a warning instead of blocking every later start).
``CP_ATTENTION_OPS=reference`` skips the build; a failed build returns ``None`` after one
warning and callers use :class:`ReferenceOps`.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import _get_build_directory, load

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
FORCE_ENV = "CP_ATTENTION_OPS"
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]
STALE_LOCK_S = 30 * 60  # a build takes ~1-2 minutes here; an older lock has no live owner


def forced_reference() -> bool:
    """True when ``CP_ATTENTION_OPS=reference`` asks for the pure-torch ops."""
    return os.environ.get(FORCE_ENV, "").strip().lower() == "reference"


def _cpu_signature() -> str:
    """The instruction-set flags of this CPU (``-march=native`` binaries depend on them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def extension_name(sources: list[Path]) -> str:
    """Module name unique to the sources' contents, the flags, the CPU and the interpreter
    (each venv gets its own build: their ninja files differ, so a shared one would thrash)."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    digest.update(_cpu_signature().encode())
    digest.update(f"{sys.prefix}|{torch.__version__}|{torch.__file__}".encode())
    return f"cp_attention_cpu_{digest.hexdigest()[:16]}"


@functools.cache
def load_cpu_extension() -> ModuleType | None:
    """The compiled kernels module, or None (forced reference, or the build failed)."""
    if forced_reference():
        return None
    sources = sorted(CSRC_DIR.glob("*.cpp"))
    headers = sorted(CSRC_DIR.glob("*.h"))
    name = extension_name(sources + headers)
    built = _load_built(name)
    if built is not None:
        return built
    clear_stale_lock(name)
    try:
        return load(name=name, sources=[str(p) for p in sources],
                    extra_include_paths=[str(CSRC_DIR)], extra_cflags=_CFLAGS,
                    extra_ldflags=_LDFLAGS, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a compile error: fall back, loudly once
        warnings.warn(f"cp_attention: building the C++ CPU attention kernels failed "
                      f"({_first_error(exc)}); using the slower pure-torch ReferenceOps. "
                      f"Set {FORCE_ENV}=reference to skip the build.", RuntimeWarning,
                      stacklevel=2)
        return None


def _load_built(name: str) -> ModuleType | None:
    """The module if this exact build exists already: imported without cpp_extension's build
    lock and ninja run (fast start, and no wait on a lock left by a killed process)."""
    path = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # e.g. an interrupted link: rebuild through cpp_extension
        return None


def clear_stale_lock(name: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock of extension ``name`` if it is older than ``max_age_s`` (its
    owner was killed mid-build; cpp_extension would wait on it forever). True if removed."""
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False
    warnings.warn(f"cp_attention: removing a stale build lock {lock} ({age / 60:.0f} min old; "
                  "a build was interrupted)", RuntimeWarning, stacklevel=3)
    lock.unlink(missing_ok=True)
    return True


def _first_error(exc: Exception) -> str:
    """The compiler's first error line of a failed build, else the exception's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return f"{type(exc).__name__}: {(errors or lines or [''])[0]}"
