"""The planner: predict memory and step time of any model, cluster and parallel layout, and search for
the best layout, with pure functions (no process group). See docs/PLANNER.md.

Public API (a contract other code calls): model_state_bytes, activation_bytes_per_layer,
flops_per_iteration, bubble_fraction; plus estimate, search, choose_local_layout and the catalogues.
"""

from tessera.planner.catalog import GPUS, MODELS, GpuSpec, ModelSpec, from_model_config, get_gpu, get_model
from tessera.planner.estimate import Estimate, estimate, memory_per_rank, step_time
from tessera.planner.flops import bubble_fraction, flops_per_iteration, model_flops
from tessera.planner.layout import Layout
from tessera.planner.local import choose_local_layout
from tessera.planner.memory import (activation_bytes_per_layer, inflight_microbatches,
                                    llama_activation_bytes_per_layer, model_state_bytes)
from tessera.planner.search import NoLayoutFits, Plan, SearchSpace, enumerate_layouts, search

__all__ = [
    "GPUS", "MODELS", "Estimate", "GpuSpec", "Layout", "ModelSpec", "NoLayoutFits", "Plan", "SearchSpace",
    "activation_bytes_per_layer", "bubble_fraction", "choose_local_layout", "enumerate_layouts", "estimate",
    "flops_per_iteration", "from_model_config", "get_gpu", "get_model", "inflight_microbatches",
    "llama_activation_bytes_per_layer", "memory_per_rank", "model_flops", "model_state_bytes", "search",
    "step_time",
]
