"""Builds and loads the C++ CPU attention kernels (``ops/csrc/*.cpp``) once per machine.

The library registers them as torch operators, ``torch.ops.cp_attention.*`` (schemas, CPU and
Meta kernels: ``csrc/bindings.cpp``); :func:`load_cpu_extension` returns that namespace.

``cp-attn build`` (:func:`build_main`) compiles them ahead of time, so a server's first
forward never compiles. Otherwise the first call compiles (the JIT fallback): every
``csrc/*.cpp`` into one extension with ``torch.utils.cpp_extension.load`` (:data:`BUILD_TIME`;
ninja + a C++17 compiler), cached in torch's extension directory (``$TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``) under a name that hashes the sources, the flags and
the CPU's instruction set, so edited sources or another machine never load a stale binary.
Processes starting at once share one build (cpp_extension's file lock; a lock older than
:data:`STALE_LOCK_S`, left by a process killed while building, is removed with a warning
instead of blocking every later start).
``CP_ATTENTION_OPS=reference`` skips the build (logged at INFO); a failed build returns
``None`` and callers use :class:`ReferenceOps`. The failed build and a compile in the first
call are logged as warnings on the ``cp_attention`` logger (what a server operator's log
shows; the failed build also raises one ``RuntimeWarning``), naming the reason.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from torch._ops import _OpNamespace
from torch.utils.cpp_extension import _get_build_directory, load

from cp_attention import envs

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
FORCE_ENV = "CP_ATTENTION_OPS"
# Tuples: cpp_extension appends its own flags to the lists it is given, which would change
# extension_name() after a first build (a second build in the same process would then register
# the torch.library namespace twice and abort).
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fno-math-errno")
_LDFLAGS = ("-fopenmp",)
STALE_LOCK_S = 30 * 60  # far above a build under load; an older lock has no live owner
BUILD_TIME = "about 1 minute on 2 cores"  # measured: docs/devices.md, CPU ops
log = logging.getLogger("cp_attention")


def forced_reference() -> bool:
    """True when ``CP_ATTENTION_OPS=reference`` asks for the pure-torch ops."""
    return envs.CP_ATTENTION_OPS == "reference"


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


def _sources() -> tuple[list[Path], str]:
    """The ``.cpp`` files compiled and the extension's name (hashing them and the headers)."""
    sources = sorted(CSRC_DIR.glob("*.cpp"))
    return sources, extension_name(sources + sorted(CSRC_DIR.glob("*.h")))


def extension_path() -> Path:
    """Where the built module of the current sources is (or will be)."""
    _, name = _sources()
    return _module_path(name)


def _module_path(name: str) -> Path:
    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


@functools.cache
def load_cpu_extension() -> _OpNamespace | None:
    """``torch.ops.cp_attention`` with the compiled kernels loaded, or None (forced reference,
    or the build failed)."""
    if forced_reference():
        log.info("cp_attention: %s=reference: the C++ CPU kernels are off, the slower "
                 "pure-torch ReferenceOps run", FORCE_ENV)
        return None
    sources, name = _sources()
    built = _load_built(name)
    if built is not None:
        return built
    log.warning("cp_attention: compiling the C++ CPU attention kernels now (%s, once per "
                "machine; `cp-attn build` does it ahead of time) into %s", BUILD_TIME,
                _module_path(name).parent)
    try:
        return _compile(name, sources)
    except Exception as exc:  # no compiler, no ninja, a compile error: fall back, loudly once
        message = (f"cp_attention: building the C++ CPU attention kernels failed "
                   f"({_first_error(exc)}); using the slower pure-torch ReferenceOps. "
                   f"`cp-attn build` shows the whole error; set {FORCE_ENV}=reference to "
                   f"skip the build.")
        log.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return None


def _compile(name: str, sources: list[Path], verbose: bool = False) -> _OpNamespace:
    """Build (or rebuild) library ``name`` through cpp_extension and load it, after clearing a
    stale lock; raises what the build raises."""
    clear_stale_lock(name)
    load(name=name, sources=[str(p) for p in sources], extra_include_paths=[str(CSRC_DIR)],
         extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS), is_python_module=False,
         verbose=verbose)
    return torch.ops.cp_attention


def _load_built(name: str) -> _OpNamespace | None:
    """The ops if this exact build exists already: loaded without cpp_extension's build lock
    and ninja run (fast start, and no wait on a lock left by a killed process)."""
    path = _module_path(name)
    if not path.is_file():
        return None
    try:
        torch.ops.load_library(str(path))
    except Exception:  # e.g. an interrupted link: rebuild through cpp_extension
        return None
    return torch.ops.cp_attention


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


def build_main(argv: list[str] | None = None) -> int:
    """``cp-attn build``: compile the C++ CPU kernels now (nothing to do when this machine has
    them already) and print where the module is and how long it took. Exit status 0 when the
    kernels load, 1 when the build failed (with the compiler's output)."""
    parser = argparse.ArgumentParser(
        prog="cp-attn build",
        description="Compile cp_attention's C++ CPU attention kernels ahead of time (once per "
                    "machine, sources and interpreter), so no process compiles them in its "
                    f"first forward. Cached under ${{TORCH_EXTENSIONS_DIR}} "
                    "(default ~/.cache/torch_extensions).")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    if forced_reference():
        print(f"cp-attn build: {FORCE_ENV}=reference is set: the C++ kernels are not used, "
              "nothing built")
        return 0
    sources, name = _sources()
    path = _module_path(name)
    start = time.perf_counter()
    if _load_built(name) is not None:
        print(f"cp-attn build: already built: {path} (loaded in "
              f"{time.perf_counter() - start:.2f} s)")
        return 0
    print(f"cp-attn build: compiling {len(sources)} sources ({BUILD_TIME}) ...", flush=True)
    try:
        _compile(name, sources, args.verbose)
    except Exception as exc:
        print(f"cp-attn build: FAILED after {time.perf_counter() - start:.1f} s: "
              f"{_first_error(exc)}\n{exc}", file=sys.stderr)
        return 1
    print(f"cp-attn build: built in {time.perf_counter() - start:.1f} s: {path}")
    return 0
