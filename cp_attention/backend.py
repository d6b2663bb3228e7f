"""The attention backend: names, KV cache layout and routing to the CP classes."""
from __future__ import annotations

import torch

from cp_attention.config import CPConfig
from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.impl.cp import CPAttentionImpl
from cp_attention.metadata.builder import AttentionMetadata, MetadataBuilder
from cp_attention.ops.checks import validate_kv_cache_shape_args


class CPAttentionBackend:
    """Static description of the backend, in the shape of vLLM's ``AttentionBackend``."""

    accept_output_buffer = True
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def get_name() -> str:
        return "CP_ATTENTION"

    @staticmethod
    def get_impl_cls(config: CPConfig | None = None) -> type[BaseAttentionImpl]:
        """The single-device impl, or the CP impl when pcp_size or dcp_size > 1."""
        return CPAttentionImpl if config is not None and config.uses_cp else BaseAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MetadataBuilder]:
        """The metadata builder (one class for every pcp/dcp size)."""
        return MetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return AttentionMetadata

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, int, int, int, int]:
        """(2, num_blocks, block_size, num_kv_heads, head_size): keys then values."""
        validate_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)
