"""Every environment variable cp_attention reads, in one place (as ``vllm/envs.py``).

Each variable has a type, a default and a meaning (:data:`VARIABLES`); ``envs.NAME`` reads it
now, parsed (``import cp_attention.envs as envs; envs.CP_ATTENTION_DEBUG``). One rule for
booleans: ``1/true/yes/on`` is True, ``0/false/no/off`` or empty is False, case and spaces
ignored; any other value raises :class:`EnvError` naming the variable. docs/envs.md is the
table :func:`markdown_table` writes (``tests/test_envs.py`` checks it is current).

The launch code alone reads torchrun's own variables (``RANK``, ``WORLD_SIZE``, ...) directly.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class EnvError(ValueError):
    """An environment variable holds a value its type cannot take."""


def parse_bool(name: str, raw: str) -> bool:
    """The one boolean rule (see the module docstring)."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(f"{name}={raw!r} is not a boolean: use one of "
                   f"{'/'.join(_TRUE)} or {'/'.join(v for v in _FALSE if v)} (or leave it empty)")


def _choice(*values: str) -> Callable[[str, str], str]:
    """One of ``values``, the first when empty."""
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower() or values[0]
        if value not in values:
            raise EnvError(f"{name}={raw!r} must be one of {', '.join(repr(v) for v in values)}")
        return value
    parse.__doc__ = f"one of {', '.join(values)}"
    return parse


def _path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _text(name: str, raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``parse(name, raw)`` turns its text into its value."""

    name: str
    kind: str  # the type as the docs show it
    default: Any  # the value when unset
    meaning: str
    parse: Callable[[str, str], Any]

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        return self.default if raw is None else self.parse(self.name, raw)


def _bool(name: str, default: bool, meaning: str) -> Variable:
    return Variable(name, "bool", default, meaning, parse_bool)


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    _bool("CP_ATTENTION_DEBUG", False,
          "Run the O(n) value checks of every forward call (slot ranges, monotone offsets, "
          "block ids, finite inputs) besides the O(1) ones; the test suite turns it on."),
    Variable("CP_ATTENTION_OPS", "auto or reference", "auto",
             "`reference`: the pure-torch ops on CPU, no C++ build (`auto`: the C++ kernels).",
             _choice("auto", "reference")),
    _bool("CP_ATTENTION_STRICT_OPS", False,
          "A kernel op handing a call to pure torch (a dtype, device or stride its kernel does "
          "not take, CUDA without flash-attn, a failed C++ build) raises `KernelFallbackError` "
          "instead of logging a warning once per op and reason; the vLLM test tier turns it on."),
    Variable("CP_ATTENTION_CACHE", "path", Path.home() / ".cache" / "cp_attention",
             "Where benchmarks and the vLLM tier keep what they build or convert once "
             "(the cpu_limits loops, the real checkpoints).", _path),
    _bool("CP_ATTENTION_VLLM", False,
          "Opt in to cp_attention inside vLLM: its backend for CPU_ATTN and the PCP worker "
          "(docs/vllm.md). Unset, the installed plugin does nothing."),
    _bool("CP_ATTENTION_VLLM_REORDER", True,
          "Let vLLM reorder each batch decodes first, as our rows are (off: rows are gathered "
          "and scattered by index every step)."),
    _bool("CP_ATTENTION_VLLM_SHM", True,
          "Run the PCP exchange on vLLM CPU's shared-memory all-gather (off: gloo)."),
    _bool("CP_ATTENTION_VLLM_SPLIT_LM_HEAD", True,
          "Split the lm_head's vocab over the PCP ranks (off: every rank projects the whole "
          "vocab)."),
    _bool("CP_ATTENTION_VLLM_CHECK_TOKENS", False,
          "Debug: after every step all PCP ranks compare the sampled tokens and raise on a "
          "difference."),
    _bool("CP_ATTENTION_REQUIRE_VLLM", False,
          "Test suite: a missing vLLM is an error and any skipped vLLM test fails the run "
          "(.ci/run_vllm)."),
    Variable("CP_ATTENTION_VLLM_VENV", "path", Path(".venv-vllm"),
             "CI: the venv folder `.ci/run_vllm` (a bash script, which reads it itself) builds "
             "for the vLLM tier.", _path),
    Variable("VLLM_DIST_IDENT", "text (vLLM's)", None,
             "Set by vLLM CPU in its workers; names the shared-memory segment of the PCP "
             "exchange (read, never set, by cp_attention).", _text),
)}


def __getattr__(name: str) -> Any:
    """``envs.NAME``: the variable's current value, parsed (read at each access)."""
    variable = VARIABLES.get(name)
    if variable is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return variable.read()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(VARIABLES))


@contextlib.contextmanager
def overridden(**values: str | None) -> Iterator[None]:
    """Set (a string) or unset (None) variables for the duration of the block, for child
    processes that read them at start (``OMP_NUM_THREADS``); restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _assign(name, value)
        yield
    finally:
        for name, value in saved.items():
            _assign(name, value)


def _assign(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def markdown_table() -> str:
    """docs/envs.md's table: every variable with its type, default and meaning."""
    home = str(Path.home())
    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        default = "unset" if v.default is None else str(v.default).replace(home, "~")
        if isinstance(v.default, bool):
            default = "1" if v.default else "0"
        lines.append(f"| `{v.name}` | {v.kind} | `{default}` | {v.meaning} |")
    return "\n".join(lines) + "\n"
