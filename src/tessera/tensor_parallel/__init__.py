"""Tensor parallelism: Megatron 1D (+ sequence parallelism) and Colossal-AI's 2D / 2.5D / 3D layers.

Entry point for the trainer: ``apply_tensor_parallel(model, topology.group("tp"), TensorParallelConfig(...))``
then ``TensorParallelLoss(tp_group)`` in place of ``cross_entropy_sum``; clipping is
``tessera.grad_norm.clip_grad_norm`` with the weights that ``is_sharded`` names split over "tp".
"""

from tessera.tensor_parallel.config import TensorParallelConfig
from tessera.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear, is_sharded
from tessera.tensor_parallel.plan import CheckpointedCore, SequenceParallelRMSNorm, apply_tensor_parallel, default_plan
from tessera.tensor_parallel.regions import gather_seq, reduce_scatter_seq
from tessera.tensor_parallel.rng import TensorParallelDropout, TensorParallelRNG
from tessera.tensor_parallel.vocab import (
    TensorParallelLoss,
    VocabParallelEmbedding,
    VocabParallelHead,
    gather_logits,
    padded_vocab,
    vocab_parallel_cross_entropy_sum,
)

__all__ = [
    "TensorParallelConfig", "apply_tensor_parallel", "default_plan", "TensorParallelLoss",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
    "SequenceParallelRMSNorm", "CheckpointedCore", "TensorParallelDropout", "TensorParallelRNG",
    "vocab_parallel_cross_entropy_sum", "gather_logits", "padded_vocab", "gather_seq", "reduce_scatter_seq",
    "is_sharded",
]
