"""cp_attention: context-parallel (PCP + DCP) attention for long-sequence LLM inference."""
from cp_attention.backend import CPAttentionBackend
from cp_attention.config import CPConfig, CPRanks, heads_of_rank
from cp_attention.errors import (AttentionLayerError, KernelFallbackError, OpsInputError, StepError,
                                 StepMismatchError)
from cp_attention.impl.base import BaseAttentionImpl
from cp_attention.impl.cp import CPAttentionImpl
from cp_attention.metadata.builder import AttentionMetadata, MetadataBuilder
from cp_attention.metadata.common import AttentionState, StepSpec
from cp_attention.parallel import CPGroups

__all__ = [
    "AttentionLayerError", "AttentionMetadata", "AttentionState", "BaseAttentionImpl",
    "CPAttentionBackend", "CPAttentionImpl", "CPConfig", "CPGroups", "CPRanks",
    "KernelFallbackError", "MetadataBuilder", "OpsInputError", "StepError", "StepMismatchError",
    "StepSpec", "heads_of_rank",
]
__version__ = "0.1.0"
