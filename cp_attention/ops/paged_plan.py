"""Device-neutral plan of a paged-attention call: which requests share one kernel mask.

Kernels with paged K/V (torch_npu's fused attention, and the packed varlen path of the CUDA
ops) take one mask kind per call, while the interface allows any per-query key range
``[kv_start[i], kv_end[i])``. :func:`plan_paged` groups requests whose ranges one mask
expresses ("full", bottom-right "causal", or "band" = causal with a window) and cuts the others
into one-row requests. Pure python over python ints; each device translates a
:class:`KernelCall`'s :meth:`~KernelCall.interface_mask` to its own arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from cp_attention.ops.interface import Mask

MASKS = ("full", "causal", "band")


@dataclass(frozen=True)
class VirtualRequest:
    """One request of a kernel call: query rows ``rows`` (packed indices, consecutive),
    the cache request ``source`` (block-table row), its first visible block ``block_offset``
    and the visible key count ``kv_len`` counted from that block's start."""

    rows: tuple[int, ...]
    source: int
    block_offset: int
    kv_len: int


@dataclass
class KernelCall:
    """One kernel call: every request uses ``mask`` (one of :data:`MASKS`); ``window`` is the
    band's key count (keys ``pos - window < k <= pos``), None for the other masks."""

    mask: str
    window: int | None = None
    requests: list[VirtualRequest] = field(default_factory=list)

    def interface_mask(self) -> Mask:
        """The call's mask as the interface describes it (the devices translate that one)."""
        return Mask(self.mask != "full", self.window)

    def query_rows(self) -> list[int]:
        """Packed query rows of the call, request after request."""
        return [i for req in self.requests for i in req.rows]

    def cu_seqlens_q(self) -> list[int]:
        """[B + 1] cumulative query bounds of the call's requests, from 0."""
        return [0, *accumulate(len(req.rows) for req in self.requests)]

    def kv_lengths(self) -> list[int]:
        """[B] visible key count of each request, counted from its first visible block."""
        return [req.kv_len for req in self.requests]


def _causal_end(hi: list[int], seq_len: int) -> int | None:
    """E such that hi[i] == clip(E - n + 1 + i, 0, seq_len) for every row, else None."""
    n = len(hi)
    end = hi[-1]
    expect = [min(max(end - n + 1 + i, 0), seq_len) for i in range(n)]
    return end if expect == hi else None


def classify_ranges(lo: list[int], hi: list[int], seq_len: int) -> tuple[str, int, int] | None:
    """Classify one request's clipped per-query ranges ``[lo[i], hi[i])`` over its cache.

    Returns (kind, kv_end, window) with kind "full" (every row sees ``[0, kv_end)``), "causal"
    (bottom-right causal over ``[0, kv_end)``) or "band" (causal with window ``window``), or
    None when no single mask expresses the ranges.
    """
    if not hi:
        return None
    end = _causal_end(hi, seq_len)
    if all(x == 0 for x in lo):
        if all(x == hi[0] for x in hi):
            return "full", hi[0], 0
        if end is not None:
            return "causal", end, 0
        return None
    if end is None:
        return None
    window = hi[-1] - lo[-1]
    if window < 1:
        return None
    if lo == [max(h - window, 0) for h in hi] and all(
            end - len(hi) + 1 + i >= 0 for i in range(len(hi))):
        return "band", end, window
    return None


def plan_paged(cu_q: list[int], seq_lens: list[int], block_size: int,
               kv_start: list[int] | None, kv_end: list[int] | None
               ) -> tuple[list[KernelCall], torch.Tensor]:
    """Split a paged-attention request set into fused-attention calls.

    cu_q: [R + 1] cumulative query bounds; seq_lens: [R]; kv_start / kv_end: [Tq] or None.
    Requests whose ranges one mask expresses stay whole; the others are cut into
    one-row requests (any ``[lo, hi)`` is a band of width ``hi - lo`` for a single row; when
    ``lo`` falls on a block boundary it is a plain prefix of a shifted block table).
    Returns the calls (grouped by mask and window) and a [Tq] bool of rows that see keys.
    """
    total = cu_q[-1]
    visible = torch.zeros(total, dtype=torch.bool)
    groups: dict[tuple[str, int | None], KernelCall] = {}

    def add(mask: str, window: int, req: VirtualRequest) -> None:
        key = (mask, window if mask == "band" else None)
        groups.setdefault(key, KernelCall(*key)).requests.append(req)

    for r, seq_len in enumerate(seq_lens):
        qs, qe = cu_q[r], cu_q[r + 1]
        if qe == qs or seq_len == 0:
            continue
        lo = [0] * (qe - qs) if kv_start is None else [min(max(x, 0), seq_len)
                                                        for x in kv_start[qs:qe]]
        hi = [seq_len] * (qe - qs) if kv_end is None else [min(max(x, 0), seq_len)
                                                           for x in kv_end[qs:qe]]
        rows = tuple(range(qs, qe))
        for i, (a, b) in enumerate(zip(lo, hi)):
            visible[qs + i] = b > a
        kind = classify_ranges(lo, hi, seq_len)
        if kind is not None and kind[1] > 0:
            name, end, window = kind
            if name == "band" and window >= end:
                name = "causal"
            add(name, window, VirtualRequest(rows, r, 0, end))
            continue
        if kind is not None:  # every row empty
            continue
        for i, (a, b) in enumerate(zip(lo, hi)):
            if b <= a:
                continue
            shift = a // block_size
            start = shift * block_size
            row_req = VirtualRequest((qs + i,), r, shift, b - start)
            if a == start:
                add("full", 0, row_req)
            else:
                add("band", b - a, row_req)
    return list(groups.values()), visible


