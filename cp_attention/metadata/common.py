"""The step description, attention states and the index helpers the planners share (pure)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


def _token_counts(name: str, values) -> np.ndarray:
    """[R] read-only int64 copy of ``values`` (an integer sequence, numpy array or tensor),
    checked once, vectorized: a value that is not an integer (1.5, True, "3") is an error."""
    if isinstance(values, torch.Tensor):
        values = values.numpy(force=True)
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of integers, got shape {array.shape}")
    if (array.size and array.dtype.kind not in "iu") or (  # numpy reads (True, 2) as ints
            not isinstance(values, np.ndarray) and {bool, np.bool_} & set(map(type, values))):
        i = next((i for i, v in enumerate(values) if isinstance(v, (bool, np.bool_)) or not
                  isinstance(v, (int, np.integer)) or abs(int(v)) >= 2 ** 63), 0)
        raise ValueError(f"{name}[{i}] = {values[i]!r} is not an int64 integer")
    array = array.astype(np.int64)  # a copy: the caller's array stays its own
    array.flags.writeable = False
    return array


class AttentionState(enum.Enum):
    """What kind of batch a step is (as the seed's ``AscendAttentionState``)."""

    PrefillNoCache = 0  # every request is a prefill with no cached context
    PrefillCacheHit = 1  # every request is a prefill, some start from cached context
    DecodeOnly = 2  # every request is a decode of one token
    ChunkedPrefill = 3  # anything mixed: decodes with prefills, chunked prefills
    SpecDecoding = 4  # every request is a decode, some with speculative tokens


@dataclass(frozen=True, eq=False)
class StepSpec:
    """One scheduler step, the same on every rank.

    num_computed_tokens[r]: tokens of request r already in the KV cache;
    num_scheduled_tokens[r]: new tokens of request r in this step (>= 1);
    block_table: [R, max_blocks] integer tensor of (virtual) block ids per request.
    The step's new tokens are numbered in batch order: request r's tokens are global token
    indices ``cu_new_tokens[r] .. cu_new_tokens[r + 1] - 1``.

    The counts (any integer sequence, numpy array or tensor) are kept as read-only [R] int64
    arrays (also named ``computed`` / ``scheduled``), checked once here, vectorized.
    """

    num_computed_tokens: np.ndarray
    num_scheduled_tokens: np.ndarray
    block_table: torch.Tensor

    def __post_init__(self) -> None:
        computed = _token_counts("num_computed_tokens", self.num_computed_tokens)
        scheduled = _token_counts("num_scheduled_tokens", self.num_scheduled_tokens)
        object.__setattr__(self, "num_computed_tokens", computed)
        object.__setattr__(self, "num_scheduled_tokens", scheduled)
        if len(computed) != len(scheduled):
            raise ValueError(f"num_computed_tokens has {len(computed)} requests but "
                             f"num_scheduled_tokens has {len(scheduled)}")
        if not len(computed):
            raise ValueError("a step needs at least one request")
        for name, values, low in (("num_computed_tokens", computed, 0),
                                  ("num_scheduled_tokens", scheduled, 1)):
            bad = np.flatnonzero(values < low)
            if len(bad):
                r = int(bad[0])
                raise ValueError(f"{name}[{r}] = {int(values[r])} must be >= {low}")
        bt = self.block_table
        if not isinstance(bt, torch.Tensor) or bt.dim() != 2 or bt.dtype.is_floating_point:
            raise ValueError("block_table must be a 2-D integer tensor [num_reqs, max_blocks]")
        if bt.shape[0] != len(computed):
            raise ValueError(f"block_table has {bt.shape[0]} rows for {len(computed)} requests")

    @property
    def computed(self) -> np.ndarray:
        """[R] int64 ``num_computed_tokens`` (read-only)."""
        return self.num_computed_tokens

    @property
    def scheduled(self) -> np.ndarray:
        """[R] int64 ``num_scheduled_tokens`` (read-only)."""
        return self.num_scheduled_tokens

    @cached_property
    def cu_new_tokens(self) -> np.ndarray:
        """[R + 1] int64 offsets of each request's new tokens (read-only)."""
        out = cumsum0(self.scheduled)
        out.flags.writeable = False
        return out

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @cached_property
    def seq_lens(self) -> np.ndarray:
        """[R] int64 context + new tokens (read-only)."""
        out = self.computed + self.scheduled
        out.flags.writeable = False
        return out

    @property
    def num_new_tokens(self) -> int:
        return int(self.cu_new_tokens[-1])


def decode_mask(spec: StepSpec, decode_threshold: int) -> np.ndarray:
    """[R] bool: request is a decode (cached context and at most ``decode_threshold`` new tokens)."""
    return (spec.computed > 0) & (spec.scheduled <= decode_threshold)


def classify_state(num_reqs: int, num_decodes: int, num_decode_tokens: int,
                   has_context: bool) -> AttentionState:
    """The attention state of a step of ``num_reqs`` requests, ``num_decodes`` of them decodes
    with ``num_decode_tokens`` new tokens in all; ``has_context``: some request has cached
    tokens."""
    if num_decodes == num_reqs:
        one_token = num_decode_tokens == num_decodes
        return AttentionState.DecodeOnly if one_token else AttentionState.SpecDecoding
    if num_decodes == 0:
        return AttentionState.PrefillCacheHit if has_context else AttentionState.PrefillNoCache
    return AttentionState.ChunkedPrefill


def cumsum0(lengths: np.ndarray) -> np.ndarray:
    """[n] lengths -> [n + 1] int64 offsets starting at 0."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.add.accumulate(lengths, out=out[1:])  # = cumsum, without the method's overhead
    return out


_LARGE_OUTPUT = 1 << 16  # rows from which checking the lengths for equal ones pays


def ranges_concat(starts: np.ndarray, lengths: np.ndarray, equal: bool | None = None
                  ) -> np.ndarray:
    """[sum(lengths)] int64: the concatenation of ``arange(s, s + n)`` for each (s, n).

    starts, lengths: [n] int64 arrays (lengths >= 0). Written with as few numpy calls as
    possible (each costs microseconds; the planner makes several per step): one output-sized
    ``arange`` shifted in place by each segment's ``start - offset``. Equal segments take one
    broadcast ``starts[:, None] + arange(n)`` instead (a single pass over the output, no
    output-sized ``arange``). ``equal``: the caller knows whether all lengths are equal (None:
    checked here for large outputs only).
    """
    if len(lengths) == 1:
        return np.arange(starts[0], starts[0] + lengths[0], dtype=np.int64)
    if equal and len(lengths):
        return equal_ranges(starts, int(lengths[0]))
    ends = np.add.accumulate(lengths)
    total = int(ends[-1]) if len(ends) else 0
    if equal is None and total >= _LARGE_OUTPUT and bool((lengths == lengths[0]).all()):
        return equal_ranges(starts, int(lengths[0]))
    out = np.arange(total, dtype=np.int64)
    out += (starts + lengths - ends).repeat(lengths)
    return out


def equal_ranges(starts: np.ndarray, length: int) -> np.ndarray:
    """[n * length] int64: ``arange(s, s + length)`` for each of the [n] starts, concatenated."""
    return (starts[:, None] + np.arange(length, dtype=np.int64)).reshape(-1)
