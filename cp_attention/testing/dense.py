"""Float64 dense attention of a request's new tokens over its whole sequence (the oracle).

Independent of :mod:`cp_attention.ops`: explicit scores, mask and softmax in float64.
"""
from __future__ import annotations

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    scale: float, causal: bool = True, window: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [n, Hq, D] at ``positions`` [n]; k, v: [L, Hkv, D] the sequence's keys 0..L-1.

    Returns float64 (out [n, Hq, D], lse [n, Hq]); rows seeing no key give 0 / -inf.
    """
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    key_pos = torch.arange(k.shape[0])
    visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if causal:
        visible &= key_pos[None, :] <= positions[:, None]
    if window is not None:
        visible &= key_pos[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v), lse.transpose(0, 1)
