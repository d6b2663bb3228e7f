"""Pure argument preparation for the torch_npu kernels used by :mod:`cp_attention.ops.npu`.

Nothing here imports torch_npu, so every convention is tested on CPU. Conventions follow the
torch_npu docs (Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_
attention_score.md`` and ``torch_npu-npu_fusion_attention.md``) and vllm-ascend's
``vllm_ascend/attention/attention_v1.py`` / ``context_parallel/attention_cp.py``:

* ``input_layout="TND"``: ``actual_seq_lengths`` (queries) are *cumulative* end offsets, one
  per request, as python ints; ``actual_seq_lengths_kv`` is cumulative for contiguous K/V and
  *per request* (not cumulative) when ``block_table`` enables PageAttention;
* ``sparse_mode`` 0: no mask; 3: right-down (bottom-right) causal; 4: band, where query ``i``
  of a request sits at key position ``p = n_k - n_q + i`` and sees keys ``k`` with
  ``p - pre_tokens <= k <= p + next_tokens``. Modes 2/3/4 take the compressed 2048 x 2048 mask
  (``True``/1 = masked, upper triangle);
* ``softmax_lse`` is ``[T, N, 1]`` float32 for TND.
"""
from __future__ import annotations

import torch

from cp_attention.ops.interface import Mask
from cp_attention.ops.paged_plan import KernelCall

SPARSE_NONE = 0
SPARSE_RIGHT_DOWN_CAUSAL = 3
SPARSE_BAND = 4
MAX_TOKENS = 2147483647  # the op's default pre_tokens / next_tokens ("unbounded")
COMPRESSED_MASK_SIZE = 2048
KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # FIA query/key/value dtypes (int8 aside)


def cumulative_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """[R + 1] cumulative offsets starting at 0 -> the TND list ``[e_0, ..., e_{R-1}]``."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if not bounds or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[:1]}")
    return bounds[1:]


def band_tokens(mask: Mask) -> tuple[int, int]:
    """(pre_tokens, next_tokens) of a mask under the band rule above: its ``bounds``, unbounded
    (-1) as :data:`MAX_TOKENS`.

    The interface's window ``w`` shows keys ``pos - w < k <= pos``: ``w`` keys including the
    query's own position, i.e. ``pre_tokens = w - 1``. (vllm-ascend passes
    ``pre_tokens=sliding_window``; the real-NPU contract run decides which is right.)
    """
    pre, nxt = mask.bounds
    return MAX_TOKENS if pre < 0 else pre, MAX_TOKENS if nxt < 0 else nxt


def sparse_args(mask: Mask) -> tuple[int, int, int]:
    """(sparse_mode, pre_tokens, next_tokens) of the interface's mask."""
    mode = (SPARSE_BAND if mask.window is not None else
            SPARSE_RIGHT_DOWN_CAUSAL if mask.causal else SPARSE_NONE)
    return (mode, *band_tokens(mask))


def needs_compressed_mask(sparse_mode: int) -> bool:
    return sparse_mode in (2, SPARSE_RIGHT_DOWN_CAUSAL, SPARSE_BAND)


def compressed_causal_mask(device: torch.device | str = "cpu") -> torch.Tensor:
    """The [2048, 2048] bool mask sparse modes 2/3/4 require: True (masked) above the diagonal."""
    ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def lse_to_th(lse: torch.Tensor, num_tokens: int, num_heads: int) -> torch.Tensor:
    """The op's TND ``softmax_lse`` [T, N, 1] -> the interface's [T, H]."""
    if tuple(lse.shape) != (num_tokens, num_heads, 1):
        raise ValueError(f"expected softmax_lse of shape {(num_tokens, num_heads, 1)}, "
                         f"got {tuple(lse.shape)}")
    return lse.squeeze(-1)


def visible_rows_dense(cu_q: list[int], cu_k: list[int], causal: bool) -> torch.Tensor:
    """[Tq] bool: whether each packed query row sees at least one key (varlen semantics).

    cu_q / cu_k: full [R + 1] cumulative bounds. Causal rows at position < 0 see nothing;
    a window never empties a row that causal leaves non-empty.
    """
    rows = []
    for r in range(len(cu_q) - 1):
        nq, nk = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        pos = torch.arange(nq) + (nk - nq)
        if nk == 0:
            rows.append(torch.zeros(nq, dtype=torch.bool))
        elif causal:
            rows.append(pos >= 0)
        else:
            rows.append(torch.ones(nq, dtype=torch.bool))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)


def gather_block_table(block_table: torch.Tensor, call: KernelCall) -> torch.Tensor:
    """[len(call.requests), max_blocks] int32 block table of the call's virtual requests.

    Rows of shifted requests start ``block_offset`` blocks later; the tail is padded with
    block 0 (never read: kv_len bounds the visible blocks).
    """
    width = block_table.shape[1]
    out = torch.zeros(len(call.requests), width, dtype=torch.int32, device=block_table.device)
    for i, req in enumerate(call.requests):
        row = block_table[req.source, req.block_offset:]
        out[i, : row.shape[0]] = row.to(torch.int32)
    return out


def flat_cache(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] -> the op's BnBsH view [num_blocks, block_size, Hkv*D]."""
    return cache.view(cache.shape[0], cache.shape[1], -1)


def attention_update_inputs(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Interface partials (out [T, H, D], lse [T, H]) -> npu_attention_update's lists
    (lse: [T*H] float32 each; local_out: [T*H, D] each)."""
    d = out_a.shape[-1]
    lses = [x.contiguous().reshape(-1).to(torch.float32) for x in (lse_a, lse_b)]
    outs = [x.contiguous().reshape(-1, d) for x in (out_a, out_b)]
    return lses, outs


def slot_mapping_arg(slot_mapping: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``_npu_reshape_and_cache`` takes int32 ``slot_indices`` on the cache's device; -1 means
    skip."""
    return slot_mapping.to(device=device, dtype=torch.int32).contiguous()
