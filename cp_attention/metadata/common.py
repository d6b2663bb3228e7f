"""The step description and attention states (pure data and index math)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch


def _as_ints(name: str, values) -> tuple[int, ...]:
    """Values as ints; a non-integral value (1.5, True) is an error, not truncated."""
    out = []
    for i, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or int(value) != value:
            raise ValueError(f"{name}[{i}] = {value!r} is not an integer")
        out.append(int(value))
    return tuple(out)


class AttentionState(enum.Enum):
    """What kind of batch a step is (as the seed's ``AscendAttentionState``)."""

    PrefillNoCache = 0  # every request is a prefill with no cached context
    PrefillCacheHit = 1  # every request is a prefill, some start from cached context
    DecodeOnly = 2  # every request is a decode of one token
    ChunkedPrefill = 3  # anything mixed: decodes with prefills, chunked prefills
    SpecDecoding = 4  # every request is a decode, some with speculative tokens


@dataclass(frozen=True)
class StepSpec:
    """One scheduler step, the same on every rank.

    num_computed_tokens[r]: tokens of request r already in the KV cache;
    num_scheduled_tokens[r]: new tokens of request r in this step (>= 1);
    block_table: [R, max_blocks] integer tensor of (virtual) block ids per request.
    The step's new tokens are numbered in batch order: request r's tokens are global token
    indices ``cu_new_tokens[r] .. cu_new_tokens[r + 1] - 1``.
    """

    num_computed_tokens: tuple[int, ...]
    num_scheduled_tokens: tuple[int, ...]
    block_table: torch.Tensor

    def __post_init__(self) -> None:
        computed = _as_ints("num_computed_tokens", self.num_computed_tokens)
        scheduled = _as_ints("num_scheduled_tokens", self.num_scheduled_tokens)
        object.__setattr__(self, "num_computed_tokens", computed)
        object.__setattr__(self, "num_scheduled_tokens", scheduled)
        if len(computed) != len(scheduled):
            raise ValueError(f"num_computed_tokens has {len(computed)} requests but "
                             f"num_scheduled_tokens has {len(scheduled)}")
        if not computed:
            raise ValueError("a step needs at least one request")
        for r, (c, s) in enumerate(zip(computed, scheduled)):
            if c < 0:
                raise ValueError(f"num_computed_tokens[{r}] = {c} must be >= 0")
            if s < 1:
                raise ValueError(f"num_scheduled_tokens[{r}] = {s} must be >= 1")
        bt = self.block_table
        if not isinstance(bt, torch.Tensor) or bt.dim() != 2 or bt.dtype.is_floating_point:
            raise ValueError("block_table must be a 2-D integer tensor [num_reqs, max_blocks]")
        if bt.shape[0] != len(computed):
            raise ValueError(f"block_table has {bt.shape[0]} rows for {len(computed)} requests")

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def seq_lens(self) -> np.ndarray:
        return np.asarray(self.num_computed_tokens, dtype=np.int64) + \
            np.asarray(self.num_scheduled_tokens, dtype=np.int64)

    @property
    def cu_new_tokens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.num_scheduled_tokens)]).astype(np.int64)

    @property
    def num_new_tokens(self) -> int:
        return int(sum(self.num_scheduled_tokens))


def decode_mask(spec: StepSpec, decode_threshold: int) -> np.ndarray:
    """[R] bool: request is a decode (cached context and at most ``decode_threshold`` new tokens)."""
    computed = np.asarray(spec.num_computed_tokens)
    scheduled = np.asarray(spec.num_scheduled_tokens)
    return (computed > 0) & (scheduled <= decode_threshold)


def classify_state(spec: StepSpec, decode_threshold: int) -> AttentionState:
    """The attention state of a step."""
    is_decode = decode_mask(spec, decode_threshold)
    scheduled = np.asarray(spec.num_scheduled_tokens)
    if is_decode.all():
        return AttentionState.DecodeOnly if (scheduled == 1).all() else AttentionState.SpecDecoding
    if not is_decode.any():
        has_context = np.asarray(spec.num_computed_tokens) > 0
        return AttentionState.PrefillCacheHit if has_context.any() else AttentionState.PrefillNoCache
    return AttentionState.ChunkedPrefill


def cumsum0(lengths: np.ndarray) -> np.ndarray:
    """[n] lengths -> [n + 1] offsets starting at 0 (int64)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def ranges_concat(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), vectorized (int64)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = cumsum0(lengths)
    segment = np.repeat(np.arange(len(lengths)), lengths)
    return starts[segment] + np.arange(total, dtype=np.int64) - offsets[segment]
