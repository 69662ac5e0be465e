"""Activation checkpointing: full, selective (keep matmul outputs) or every k-th block."""

from tessera.recompute.apply import apply_checkpointing, transformer_blocks
from tessera.recompute.config import RecomputeConfig

__all__ = ["RecomputeConfig", "apply_checkpointing", "transformer_blocks"]
