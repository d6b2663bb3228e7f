"""The worked example of docs/pcp.md: pcp=2, one step with fresh prompts of 5 and 8 tokens.

Every list below was derived by hand from the conventions (docs/pcp.md sections 1 and 3),
then checked against the planner; the test pins them so that docs and code cannot drift.
"""
from __future__ import annotations

import pytest
import torch

from cp_attention.config import CPConfig, CPRanks
from cp_attention.metadata.builder import MetadataBuilder
from cp_attention.metadata.common import AttentionState, StepSpec
from cp_attention.metadata.vllm_ascend import VllmAscendView

# Request 0 (5 tokens, global tokens 0..4): c = ceil(5/4) = 2, padded to 8 rows.
# Request 1 (8 tokens, global tokens 5..12): c = 2, no pad.
# Chunks of 2 rows: 0 = pos [0,1], 1 = [2,3], 2 = [4,5], 3 = [6,7].
# Rank 0 keeps chunks 0 (head) and 3 (tail); rank 1 keeps chunks 1 (head) and 2 (tail).
STEP = StepSpec(num_computed_tokens=(0, 0), num_scheduled_tokens=(5, 8),
                block_table=torch.tensor([[3], [7]]))

RESTORE = [0, 1, 8, 9, 10, 11, 2, 3, 4, 5, 12, 13, 14, 15, 6, 7]
EXPECTED = {
    0: dict(
        q_head_idx=[0, 1, 4, 5],
        q_tail_idx=[2, 3, 6, 7],
        q_full_idx=[0, 1, 4, 5, 2, 3, 6, 7],
        kv_with_q_head_nomask_idx=[],
        kv_with_q_head_mask_idx=[0, 1, 8, 9],
        kv_with_q_tail_nomask_idx=[0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13],
        kv_with_q_tail_mask_idx=[6, 7, 14, 15],
        attn_mask_seqlens=[[2, 2], [2, 2]],
        head_attn_nomask_seqlens=[[2, 2], [0, 0]],
        tail_attn_nomask_seqlens=[[2, 2], [6, 6]],
        pcp_allgather_restore_idx=RESTORE,
    ),
    1: dict(
        q_head_idx=[0, 1, 4, 5],
        q_tail_idx=[2, 3, 6, 7],
        q_full_idx=[0, 1, 4, 5, 2, 3, 6, 7],
        kv_with_q_head_nomask_idx=[0, 1, 8, 9],
        kv_with_q_head_mask_idx=[2, 3, 10, 11],
        kv_with_q_tail_nomask_idx=[0, 1, 2, 3, 8, 9, 10, 11],
        kv_with_q_tail_mask_idx=[4, 5, 12, 13],
        attn_mask_seqlens=[[2, 2], [2, 2]],
        head_attn_nomask_seqlens=[[2, 2], [2, 2]],
        tail_attn_nomask_seqlens=[[2, 2], [4, 4]],
        pcp_allgather_restore_idx=RESTORE,
    ),
}
EXPECTED_ROWS = {
    # rank: (local_token_idx, positions)
    0: ([0, 1, -1, -1, 5, 6, 11, 12], [0, 1, 0, 0, 0, 1, 6, 7]),
    1: ([2, 3, 4, -1, 7, 8, 9, 10], [2, 3, 4, 0, 2, 3, 4, 5]),
}
# Step rows = restored rows: request 0 positions 0..7 (5..7 are pads), request 1 positions 0..7.
# kv_shard="cp": 2 shards, token t on shard t % 2 at local t // 2; slot = block * 16 + local.
EXPECTED_SLOTS_CP = {
    0: [48, -1, 49, -1, 50, -1, -1, -1, 112, -1, 113, -1, 114, -1, 115, -1],
    1: [-1, 48, -1, 49, -1, -1, -1, -1, -1, 112, -1, 113, -1, 114, -1, 115],
}
# kv_shard="dcp" (dcp=1): every PCP rank stores every real token at block * 16 + t.
EXPECTED_SLOTS_DCP = [48, 49, 50, 51, 52, -1, -1, -1, 112, 113, 114, 115, 116, 117, 118, 119]


def _meta(rank: int, kv_shard: str = "cp"):
    cfg = CPConfig(pcp_size=2, block_size=16, kv_shard=kv_shard)
    return MetadataBuilder(cfg, CPRanks(pcp_rank=rank)).build(STEP)


@pytest.mark.parametrize("rank", [0, 1])
def test_split_indices(rank):
    split = _meta(rank)
    assert split.chunk_lens.tolist() == [2, 2]
    # local rows: request 0's head and tail chunk, then request 1's (the diagonals' one call)
    assert split.local_chunk_cu_seqlens.tolist() == [0, 2, 4, 6, 8]
    view = VllmAscendView(_meta(rank))
    for name, expected in EXPECTED[rank].items():
        assert getattr(view, name).tolist() == expected, name
    assert split.pcp_allgather_scatter_idx.tolist() == \
        [0, 1, 6, 7, 8, 9, 14, 15, 2, 3, 4, 5, 10, 11, 12, 13]


@pytest.mark.parametrize("rank", [0, 1])
def test_rows_and_slots(rank):
    meta = _meta(rank)
    view = VllmAscendView(meta)  # vLLM-Ascend's num_actual_tokens: the 5 + 8 tokens, no pads
    assert view.attn_state is AttentionState.PrefillNoCache and view.num_actual_tokens == 13
    assert meta.num_decode_tokens == 0 and meta.num_local_rows == 8
    tokens, positions = EXPECTED_ROWS[rank]
    assert meta.local_token_idx.tolist() == tokens
    assert meta.positions.tolist() == positions
    assert meta.prefill_cu_seqlens.tolist() == [0, 4, 8]
    assert meta.step_slot_mapping.tolist() == EXPECTED_SLOTS_CP[rank]
    assert _meta(rank, "dcp").step_slot_mapping.tolist() == EXPECTED_SLOTS_DCP


def test_gather_then_restore():
    """Rank-major all-gather of the local rows, then restore: request order, pads at the end."""
    gathered = torch.cat([_meta(r).local_token_idx for r in (0, 1)])
    assert gathered.tolist() == [0, 1, -1, -1, 5, 6, 11, 12, 2, 3, 4, -1, 7, 8, 9, 10]
    assert gathered[torch.tensor(RESTORE)].tolist() == \
        [0, 1, 2, 3, 4, -1, -1, -1, 5, 6, 7, 8, 9, 10, 11, 12]
