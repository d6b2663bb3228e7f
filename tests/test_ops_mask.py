"""One mask description (``ops.interface.Mask``): checked once, translated by each backend."""
from __future__ import annotations

import pytest
import torch

from cp_attention.errors import OpsInputError
from cp_attention.ops import CudaOps, NpuOps, cuda_args, npu_args
from cp_attention.ops.interface import Mask


# -- the mask ---------------------------------------------------------------------------------
def test_mask_translations_exact():
    """Each backend's arguments come from the one description."""
    full, causal, band = Mask(False), Mask(True), Mask(True, 5)
    assert (full.bounds, causal.bounds, band.bounds) == ((-1, -1), (-1, 0), (4, 0))  # flash-attn
    assert (full.kernel_window, causal.kernel_window, band.kernel_window) == (0, 0, 5)  # C++
    big = npu_args.MAX_TOKENS
    assert [npu_args.sparse_args(m) for m in (full, causal, band)] == [
        (npu_args.SPARSE_NONE, big, big), (npu_args.SPARSE_RIGHT_DOWN_CAUSAL, big, 0),
        (npu_args.SPARSE_BAND, 4, 0)]
    assert Mask(True, 1).bounds == (0, 0)  # a window of one key: the query's own position
    # explicit math: row i of 3 queries over 6 keys sits at position 3 + i
    assert cuda_args.dense_visibility(3, 6, band).sum(1).tolist() == [4, 5, 5]
    assert cuda_args.dense_visibility(3, 6, causal).sum(1).tolist() == [4, 5, 6]
    assert cuda_args.dense_visibility(3, 6, full).all()


@pytest.mark.parametrize("causal, window, message", [
    (False, 2, "a sliding window requires causal attention"),
    (True, 0, "window must be an integer >= 1 or None, got 0"),
    (True, -3, "window must be an integer >= 1 or None, got -3"),
    (True, 2.0, "window must be an integer >= 1 or None, got 2.0"),
    (True, True, "window must be an integer >= 1 or None, got True"),
])
def test_mask_rule_is_checked_once_when_made(causal, window, message):
    with pytest.raises(OpsInputError, match=message):
        Mask(causal, window)


@pytest.mark.parametrize("ops", [CudaOps(use_flash=False), NpuOps(kernel_dtypes=None)],
                         ids=["cuda", "npu"])
def test_every_op_rejects_a_window_without_causal(ops):
    """The backends translate the mask and never restate its rule: the one error."""
    q = torch.randn(3, 1, 8)
    with pytest.raises(OpsInputError, match="a sliding window requires causal attention"):
        ops.varlen_attention(q, q, q, torch.tensor([0, 3]), torch.tensor([0, 3]), scale=1.0,
                             causal=False, window=2)
