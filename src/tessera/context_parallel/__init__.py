"""Context parallelism: the sequence split over the ``cp`` ranks, attention made distributed.

Three selectable methods (`ContextParallelConfig.method`): ring attention, DeepSpeed-Ulysses and
Colossal-AI's ring self-attention; all use the load-balanced zig-zag layout of `layout.py`.
"""

from tessera.context_parallel.apply import apply_context_parallel, make_core
from tessera.context_parallel.config import METHODS, ContextParallelConfig
from tessera.context_parallel.layout import shard_sequence, unshard_order, zigzag_positions
from tessera.context_parallel.ring_attention import RingAttention, ring_attention
from tessera.context_parallel.ring_self_attention import RingSelfAttention, ring_self_attention
from tessera.context_parallel.ulysses import UlyssesAttention

__all__ = [
    "ContextParallelConfig", "METHODS", "apply_context_parallel", "make_core",
    "shard_sequence", "unshard_order", "zigzag_positions",
    "RingAttention", "ring_attention", "RingSelfAttention", "ring_self_attention", "UlyssesAttention",
]
