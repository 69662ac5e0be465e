"""Mixture of experts with expert parallelism (the single-device router and layer are in models/moe.py).

``apply_expert_parallel(model, ep)`` shards every MoE layer's experts over the ``ep`` group (tokens
travel by all-to-all); ``ExpertDataParallel(model, dp, edp)`` reduces dense gradients over ``dp`` and
expert gradients over ``edp`` (``ExpertZeroDataParallel``: the same with ZeRO-1/2/3 sharding or fp32 master weights);
``moe_metrics(model, groups)`` gives the per-step routing metrics.
"""

from tessera.moe.all_to_all import all_to_all, exchange_counts
from tessera.moe.data_parallel import ExpertDataParallel, expert_parallelize
from tessera.moe.expert_parallel import (
    ExpertParallelMoE,
    apply_expert_parallel,
    expert_parameters,
    global_expert_state,
)
from tessera.moe.metrics import moe_metrics
from tessera.moe.zero import ExpertZeroDataParallel, expert_zero

__all__ = [
    "ExpertDataParallel", "ExpertParallelMoE", "ExpertZeroDataParallel", "all_to_all", "apply_expert_parallel",
    "exchange_counts", "expert_parallelize", "expert_parameters", "expert_zero", "global_expert_state", "moe_metrics",
]
