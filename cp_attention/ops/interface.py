"""The attention primitives every device backend provides.

All ops take packed token-major tensors (TND: ``[tokens, heads, head_size]``) and return
the attention output together with its log-sum-exp so that partial results can be merged
exactly. Outputs of the attention ops are in the accumulation dtype (float32, or float64 for
float64 inputs): partial results are merged in that precision and cast once by the caller.

Mask conventions (shared by every implementation; :class:`Mask` is their one description):
  * causal masks are bottom-right aligned: in a request with ``n_q`` queries and ``n_k`` keys,
    query ``i`` sits at key position ``n_k - n_q + i`` and sees keys ``<=`` that position;
  * a sliding window ``w`` additionally hides keys at positions ``<= pos - w``;
  * a query row that sees no key at all returns output 0 and LSE ``-inf`` (never NaN).

A kernel implementation hands a call its kernel does not take (a dtype, device or stride) to
pure torch (``ReferenceOps``; CUDA's explicit math) only through :func:`falls_back`: logged
once per op and reason, an error under ``CP_ATTENTION_STRICT_OPS``.

Index tensors (``cu_seqlens_*``, ``seq_lens``, ``block_table``, ``slot_mapping``, ``kv_start``,
``kv_end``) may live on the host, where the metadata builder makes them: each implementation
moves what its kernel reads to the device itself (a CPU caller pays no transfer call).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from cp_attention import envs
from cp_attention.config import is_int
from cp_attention.errors import KernelFallbackError, OpsInputError

log = logging.getLogger("cp_attention")
_FALLBACKS_LOGGED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Mask:
    """The key visibility of a ``varlen_attention`` call, checked once when made: bottom-right
    ``causal``, and a sliding ``window`` of ``w >= 1`` keys (``pos - w < k <= pos``; causal only).
    Each backend translates it: :attr:`bounds` (flash-attn's ``window_size``, the NPU's
    pre/next tokens), :attr:`kernel_window` (the C++ kernel's)."""

    causal: bool
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None:
            if not is_int(self.window) or self.window < 1:
                raise OpsInputError(f"window must be an integer >= 1 or None, got "
                                    f"{self.window!r}")
            if not self.causal:
                raise OpsInputError("a sliding window requires causal attention")

    @property
    def bounds(self) -> tuple[int, int]:
        """(left, right): the query at key position ``p`` sees keys ``p - left <= k <= p +
        right``, -1 = unbounded; window ``w`` -> ``(w - 1, 0)``."""
        if self.window is not None:
            return self.window - 1, 0
        return (-1, 0) if self.causal else (-1, -1)

    @property
    def kernel_window(self) -> int:
        """The C++ kernels' window argument: ``w``, 0 for none."""
        return 0 if self.window is None else int(self.window)


def falls_back(op: str, reason: str | None) -> bool:
    """Whether kernel op ``op`` hands its call to pure torch: ``reason`` (why its kernel does
    not take the call, e.g. "q dtype torch.float64") or None (the kernel runs it). Each
    (op, reason) is logged once per process at WARNING on the ``cp_attention`` logger; under
    ``CP_ATTENTION_STRICT_OPS`` a fallback raises :class:`KernelFallbackError` instead."""
    if reason is None:
        return False
    if envs.CP_ATTENTION_STRICT_OPS:
        raise KernelFallbackError(f"{op}: its kernel does not take this call ({reason}) and "
                                  f"CP_ATTENTION_STRICT_OPS forbids the pure-torch fallback")
    if (op, reason) not in _FALLBACKS_LOGGED:
        _FALLBACKS_LOGGED.add((op, reason))
        log.warning("cp_attention: %s falls back from its kernel to pure torch: %s (logged once "
                    "per reason)", op, reason)
    return True


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention outputs and LSEs are returned in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_result(q: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of rows that see no key: out [T, Hq, D] zeros, lse [T, Hq] -inf (in ``acc``)."""
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    return out, lse


def used_key_lengths(bounds_k: list[int], used: list[int] | None) -> list[int]:
    """Keys each request attends: its ``bounds_k`` range, or ``used`` (checked to fit)."""
    ranges = [b - a for a, b in zip(bounds_k, bounds_k[1:])]
    if used is None:
        return ranges
    for r, (u, n) in enumerate(zip(used, ranges)):
        if not 0 <= u <= n:
            raise OpsInputError(f"seqused_k[{r}] = {u} outside [0, {n}] (the request's "
                                f"cu_seqlens_k range)")
    return list(used)


def used_key_rows(bounds_k: list[int], used: list[int],
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[int]]:
    """Rows of the first ``used[i]`` keys of each request's range, and their packed cumulative
    bounds: ``k[rows]`` with those bounds is what ``seqused_k`` attends (a copy)."""
    rows = [torch.arange(a, a + u, device=device) for a, u in zip(bounds_k, used)]
    packed = [0]
    for u in used:
        packed.append(packed[-1] + u)
    return (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)), packed


class AttentionOps(Protocol):
    """One device's implementation of the primitives used by the backends.

    Implementations subclass it (for the composed default of
    :meth:`cache_and_paged_attention`)."""

    name: str

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        *,
        scale: float,
        causal: bool,
        window: int | None = None,
        seqused_k: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of packed queries over packed keys, request by request.

        q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] with Hq % Hkv == 0 (GQA/MQA);
        cu_seqlens_q / cu_seqlens_k: [R + 1] cumulative lengths (int64, on any device).
        seqused_k: optional [R] integer used-key counts (vLLM / FlashAttention's name and
        meaning): request i attends only the first ``seqused_k[i]`` keys of its range
        ``[cu_seqlens_k[i], cu_seqlens_k[i + 1])`` (``0 <= seqused_k[i] <=`` the range), and
        those are its ``n_k`` for the causal / window alignment. So a caller attends a prefix
        of each request's keys without packing (copying) them; None uses whole ranges.
        Returns out [Tq, Hq, D] (accumulation dtype) and lse [Tq, Hq] (float32/float64).
        """
        ...

    def paged_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
        kv_start: torch.Tensor | None = None,
        kv_end: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of packed queries over a paged KV cache.

        q: [Tq, Hq, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, D];
        block_table: [R, max_blocks] (block ids of each request, in order);
        cu_seqlens_q: [R + 1]; seq_lens: [R] cached tokens of each request.
        kv_start / kv_end: optional [Tq] per-query visible key range ``[start, end)`` of the
        request's cached tokens (clipped to ``[0, seq_len)``). They express a causal offset
        (speculative tokens), a sliding window and a rank's local view of a sharded cache.
        Returns out [Tq, Hq, D] (accumulation dtype) and lse [Tq, Hq].
        """
        ...

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store key/value rows [T, Hkv, D] at ``slot = block * block_size + offset``.

        Rows whose slot is -1 are skipped (tokens owned by another rank, padding).
        """
        ...

    def cache_and_paged_attention(
        self,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
        kv_start: torch.Tensor | None = None,
        kv_end: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`reshape_and_cache` of the new key/value rows, then :meth:`paged_attention`
        of ``q`` over the written cache (``seq_lens`` counts the new rows): a decode layer in
        one call. This default composes the two; an implementation may fuse them."""
        self.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return self.paged_attention(q, key_cache, value_cache, block_table, cu_seqlens_q,
                                    seq_lens, scale=scale, kv_start=kv_start, kv_end=kv_end)

    def merge_attn_states(
        self,
        out_a: torch.Tensor,
        lse_a: torch.Tensor,
        out_b: torch.Tensor,
        lse_b: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact merge of two partial attentions over disjoint key sets.

        out_*: [T, H, D]; lse_*: [T, H]. Returns (out, lse) with
        ``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})``; ``-inf`` safe.
        """
        ...
