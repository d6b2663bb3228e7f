"""The attention backend: names, KV cache layout and routing to the CP classes."""
from __future__ import annotations

import torch

from cp_attention.config import CPConfig
from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.impl.cp import CPAttentionImpl
from cp_attention.metadata.builder import AttentionMetadata, CPMetadataBuilder, MetadataBuilder
from cp_attention.ops.checks import validate_kv_cache_shape_args

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


class CPAttentionBackend:
    """Static description of the backend, in the shape of vLLM's ``AttentionBackend``."""

    accept_output_buffer = True
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def get_name() -> str:
        return "CP_ATTENTION"

    @staticmethod
    def get_supported_block_sizes() -> tuple[int, ...]:
        return SUPPORTED_BLOCK_SIZES

    @staticmethod
    def get_impl_cls(config: CPConfig | None = None) -> type[BaseAttentionImpl]:
        """The single-device impl, or the CP impl when pcp_size or dcp_size > 1."""
        return CPAttentionImpl if config is not None and config.uses_cp else BaseAttentionImpl

    @staticmethod
    def get_builder_cls(config: CPConfig | None = None) -> type[MetadataBuilder]:
        return CPMetadataBuilder if config is not None and config.uses_cp else MetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return AttentionMetadata

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, int, int, int, int]:
        """(2, num_blocks, block_size, num_kv_heads, head_size): keys then values."""
        validate_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_bsh_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                               head_size: int) -> tuple[int, int, int, int]:
        """The same cache with heads flattened: (2, num_blocks, block_size, heads * head_size)."""
        CPAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads * head_size)

    @staticmethod
    def swap_blocks(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor,
                    src_to_dst: torch.Tensor) -> None:
        """Copy blocks between two caches (e.g. device <-> host). src_to_dst: [N, 2]."""
        pairs = torch.as_tensor(src_to_dst, dtype=torch.int64).reshape(-1, 2)
        src = pairs[:, 0].to(src_kv_cache.device)
        dst = pairs[:, 1].to(dst_kv_cache.device)
        dst_kv_cache[:, dst] = src_kv_cache[:, src].to(dst_kv_cache.device)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
        """Copy blocks inside each layer's cache (copy-on-write). src_to_dists: [N, 2]."""
        pairs = torch.as_tensor(src_to_dists, dtype=torch.int64).reshape(-1, 2)
        for cache in kv_caches:
            src, dst = pairs[:, 0].to(cache.device), pairs[:, 1].to(cache.device)
            cache[:, dst] = cache[:, src]
