"""Routing metrics of a step, summed over micro-batches and the ranks that hold different tokens."""

from __future__ import annotations

from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.models.moe import collect_local_stats, format_stats, moe_layers


def moe_metrics(model: nn.Module, dp: CommGroup) -> dict:
    """Call once per optimizer step on every dp rank (it all-reduces): the routing counters since the
    last call, summed over micro-batches and ranks (dp, and cp when the routers route over a cp group:
    see ``tessera.context_parallel.moe_routing``), as metrics.jsonl fields; {} for a dense model.

    Keys: ``moe_tokens_per_expert`` (kept assignments per expert, summed over MoE layers),
    ``moe_load_per_layer`` (per layer, expert load / uniform share: 1.0 is perfectly balanced),
    ``moe_dropped_frac`` (dropped / routed assignments), ``moe_aux_loss`` and ``moe_z_loss`` (token-weighted
    means over routing groups, averaged over layers; unweighted by the coefficients).
    """
    layers = moe_layers(model)
    values = collect_local_stats(model)
    if values is None:
        return {}
    comm.all_reduce(values, dp)  # float64 counters: exact sums
    cp = getattr(layers[0].router, "cp", None)  # context parallelism: each cp rank counted its tokens only
    if cp is not None:
        comm.all_reduce(values, cp)
    return format_stats(values, layers[0].num_experts)
