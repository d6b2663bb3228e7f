"""vLLM-Ascend's metadata names as a view of one rank's plan, computed on demand.

The forward reads :class:`AttentionMetadata` (flat); code written against
vLLM-Ascend's ``AscendMetadata`` / ``AscendPCPMetadata`` reads the same plan under the names
below (no kernel here reads them). ``[2, P]`` seqlens are (query lens, key lens) per prefill;
K/V indices point into the restored prefill rows; head and tail are a :class:`HeadTail`
rank's two chunks.
"""
from __future__ import annotations

import numpy as np
import torch

from cp_attention.config import CPConfig
from cp_attention.metadata.builder import AttentionMetadata
from cp_attention.metadata.common import (AttentionState, StepSpec, classify_state, cumsum0,
                                          ranges_concat)
from cp_attention.metadata.kv_layout import KVSharding


class VllmAscendView:
    """vLLM-Ascend's names of ``meta``. ``step`` and ``config`` (what it was built from) are
    read only by ``num_computed_tokens_of_pcp_dcp``; the PCP names need ``meta.pcp_partition``."""

    def __init__(self, meta: AttentionMetadata, step: StepSpec | None = None,
                 config: CPConfig | None = None) -> None:
        self.meta, self.step, self.config = meta, step, config
        if meta.pcp_partition is not None:  # HeadTail: (head chunk, tail chunk) of this rank
            self.chunks = meta.pcp_partition.chunks_of(meta.pcp_rank)

    @property
    def attn_state(self) -> AttentionState:
        meta = self.meta
        return classify_state(meta.num_reqs, meta.num_decodes, meta.num_decode_tokens,
                              meta.has_context)

    @property
    def num_actual_tokens(self) -> int:
        """The step's new tokens without padding (every rank's; == num_local_rows without PCP).
        This rank's rows are vLLM-Ascend's ``num_actual_tokens_pcp_padded // pcp_size``."""
        return self.meta.num_decode_tokens + int(self.meta.prefill_real_cu_seqlens[-1])

    @property
    def batch_seq_mask(self) -> torch.Tensor:
        """[R] bool, True where this rank holds no context of the request (context order)."""
        return self.meta.ctx_seq_lens == 0

    @property
    def num_computed_tokens_of_pcp_dcp(self) -> np.ndarray:
        """[R, pcp, dcp] cached tokens of each request (batch order) held by each rank."""
        cfg = self.config
        shard = [[cfg.kv_rank(p, d) for d in range(cfg.dcp_size)] for p in range(cfg.pcp_size)]
        return KVSharding.of(cfg).local_count(self.step.computed[:, None, None],
                                              np.array(shard)[None])

    @property
    def q_head_idx(self) -> torch.Tensor:  # [sum c] local prefill rows of head chunks
        return self.meta.chunk_q_idx[0]

    @property
    def q_tail_idx(self) -> torch.Tensor:  # [sum c] local prefill rows of tail chunks
        return self.meta.chunk_q_idx[1]

    @property
    def q_full_idx(self) -> torch.Tensor:  # [2 sum c] argsort(cat(q_head_idx, q_tail_idx))
        return torch.argsort(self.meta.chunk_q_idx.reshape(-1))

    @property
    def kv_with_q_head_nomask_idx(self) -> torch.Tensor:  # [head sum c] rows before the chunk
        return self._restored_rows(0, self.chunks[0])

    @property
    def kv_with_q_tail_nomask_idx(self) -> torch.Tensor:  # [tail sum c] rows before the chunk
        return self._restored_rows(0, self.chunks[1])

    @property
    def kv_with_q_head_mask_idx(self) -> torch.Tensor:  # [sum c] the head chunk's own rows
        return self._restored_rows(self.chunks[0], 1)

    @property
    def kv_with_q_tail_mask_idx(self) -> torch.Tensor:  # [sum c] the tail chunk's own rows
        return self._restored_rows(self.chunks[1], 1)

    @property
    def attn_mask_seqlens(self) -> torch.Tensor:  # [2, P] of the causal diagonals
        return torch.from_numpy(np.stack([self.meta.chunk_lens] * 2))

    @property
    def head_attn_nomask_seqlens(self) -> torch.Tensor:  # [2, P] of the head's unmasked part
        return torch.stack([self.meta.chunk_cu_seqlens.diff(), self.meta.chunk_keys_before[0]])

    @property
    def tail_attn_nomask_seqlens(self) -> torch.Tensor:  # [2, P] of the tail's unmasked part
        return torch.stack([self.meta.chunk_cu_seqlens.diff(), self.meta.chunk_keys_before[1]])

    @property
    def pcp_allgather_restore_idx(self) -> torch.Tensor:  # [pcp 2 sum c] gathered -> restored
        return self.meta.pcp_allgather_restore_idx

    @property
    def pcp_prefill_mask(self) -> torch.Tensor:
        """The constant 2048 x 2048 upper-triangular mask NPU kernels take for causal parts
        (vLLM-Ascend later dropped it as redundant)."""
        return torch.ones(2048, 2048, dtype=torch.bool).triu(1)

    def _restored_rows(self, first_chunk: int, num_chunks: int) -> torch.Tensor:
        """[num_chunks sum c] restored rows of chunks ``first_chunk ..`` of every prefill."""
        c = self.meta.chunk_lens
        return torch.from_numpy(ranges_concat(cumsum0(self.meta.padded_lens)[:-1]
                                              + first_chunk * c, num_chunks * c))
