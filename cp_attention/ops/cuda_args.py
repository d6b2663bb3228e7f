"""Pure argument preparation for :mod:`cp_attention.ops.cuda` (flash-attn / fallback).

flash-attn 2 conventions (``flash_attn/flash_attn_interface.py``, ``flash_attn_varlen_func``):
``cu_seqlens_q/k`` int32 [B + 1] on the device, python-int ``max_seqlen_q/k``, ``causal`` is
bottom-right aligned, ``window_size=(left, right)`` shows keys ``pos - left <= k <= pos +
right`` (-1 = unbounded: the interface's ``Mask.bounds``), and with ``return_attn_probs=True``
the varlen LSE is ``[H, total_q]`` float32 (``+inf`` for rows that see no key, which callers
turn into ``-inf``). ``seqused_k``
(int32 [B], request i uses the first ``seqused_k[i]`` keys of its ``cu_seqlens_k`` range) is a
keyword of the varlen function in vLLM's ``vllm_flash_attn`` and flash-attn 3 and an argument
of flash-attn 2's C++ ``varlen_fwd``, but flash-attn 2's Python ``flash_attn_varlen_func``
does not take it: there the used prefixes are packed
(:func:`cp_attention.ops.interface.used_key_rows`).
"""
from __future__ import annotations

import torch

import inspect
from typing import Callable

from cp_attention.mathutils import ceil_div
from cp_attention.ops.interface import Mask
from cp_attention.ops.paged_plan import KernelCall

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def int32_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[B + 1] cumulative lengths as the int32 device tensor flash-attn wants."""
    return cu_seqlens.to(device=device, dtype=torch.int32).contiguous()


def max_seqlen(bounds: list[int]) -> int:
    """Longest request of cumulative ``bounds`` ([B + 1] python ints); 0 if none."""
    return max((b - a for a, b in zip(bounds, bounds[1:])), default=0)


def lse_to_th(lse: torch.Tensor, num_tokens: int, num_heads: int) -> torch.Tensor:
    """flash-attn varlen LSE [H, total_q] -> the interface's [T, H]."""
    if tuple(lse.shape) != (num_heads, num_tokens):
        raise ValueError(f"expected LSE [{num_heads}, {num_tokens}], got {tuple(lse.shape)}")
    return lse.transpose(0, 1)


def dense_visibility(nq: int, nk: int, mask: Mask,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """[nq, nk] bool of the keys ``mask`` shows (its bounds around each bottom-right position)."""
    pos = (torch.arange(nq, device=device) + (nk - nq))[:, None]
    keys = torch.arange(nk, device=device)[None, :]
    vis = torch.ones(nq, nk, dtype=torch.bool, device=device)
    left, right = mask.bounds
    if right >= 0:
        vis &= keys <= pos + right
    if left >= 0:
        vis &= keys >= pos - left
    return vis


def paged_gather(block_table: torch.Tensor, call: KernelCall,
                 block_size: int) -> tuple[torch.Tensor, list[int]]:
    """Flat cache slots of every virtual request's keys, and their cumulative bounds.

    Returns (slots [sum kv_len] int64, cu_k [B + 1] python ints) so that
    ``cache.view(-1, Hkv, D)[slots]`` is the packed K (or V) of the call.
    """
    pieces, bounds = [], [0]
    offsets = torch.arange(block_size, device=block_table.device)
    for req in call.requests:
        n_blocks = ceil_div(req.kv_len, block_size)
        blocks = block_table[req.source, req.block_offset: req.block_offset + n_blocks].long()
        pieces.append((blocks[:, None] * block_size + offsets).reshape(-1)[: req.kv_len])
        bounds.append(bounds[-1] + req.kv_len)
    slots = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long,
                                                        device=block_table.device)
    return slots, bounds


def takes_seqused_k(varlen_func: Callable) -> bool:
    """Whether a flash-attn varlen function has a ``seqused_k`` parameter (vllm_flash_attn,
    flash-attn 3) or not (flash-attn 2's Python wrapper)."""
    try:
        return "seqused_k" in inspect.signature(varlen_func).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False

