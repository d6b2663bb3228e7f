"""Exact log-sum-exp merging of partial attention results (device independent, -inf safe)."""
from __future__ import annotations

import torch


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials over disjoint key sets. out: [T, H, D]; lse: [T, H].

    Rows where both parts are empty (lse -inf) give output 0 and lse -inf.
    """
    return merge_many(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))


def merge_many(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partials. outs: [N, T, H, D]; lses: [N, T, H]. Returns ([T, H, D], [T, H]).

    Computed in the dtype of ``outs`` (callers pass float32 or float64).
    """
    lses = lses.to(outs.dtype)
    lse_max = lses.amax(dim=0)
    # All parts empty: use 0 as the reference so exp() below gives 0 instead of NaN.
    lse_ref = torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lses - lse_ref)  # [N, T, H], 0 for empty parts
    total = weights.sum(dim=0)  # [T, H]
    lse = torch.log(total) + lse_ref  # -inf where total == 0
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    out = (weights.unsqueeze(-1) * outs).sum(dim=0) / safe_total.unsqueeze(-1)
    return out, lse
