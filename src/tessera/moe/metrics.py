"""Routing metrics of a step, summed over micro-batches and the ranks that hold different tokens."""

from __future__ import annotations

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.models.moe import collect_local_stats, format_stats, moe_layers


def moe_metrics(model: nn.Module, groups: list[CommGroup], model_cfg=None) -> dict:
    """Call once per logged step on every rank (it all-reduces): the routing counters since the last call,
    summed over micro-batches and over ``groups``, as metrics.jsonl fields; {} for a dense model.

    ``groups``: the ranks whose counters add up, in order — the data-parallel ranks (``[dp]``), or for the
    trainer ``[pp, dp × cp]`` (each layer lives on one pp rank; under cp each rank counted its tokens
    only: ``tessera.context_parallel.moe_routing``; tp ranks count the same tokens, so never tp).
    ``model_cfg``: given, ``model`` holds ``layers`` keyed by the model's block index (the whole
    Transformer, or the holder of a pipeline rank's stages) and each rank fills its MoE layers' rows of a
    [MoE layers of ``model_cfg``, 2E + 5] table; None, every MoE layer of ``model`` is on this rank.

    Keys: ``moe_tokens_per_expert`` (kept assignments per expert, summed over MoE layers),
    ``moe_load_per_layer`` (per layer, expert load / uniform share: 1.0 is perfectly balanced),
    ``moe_dropped_frac`` (dropped / routed assignments), ``moe_aux_loss`` and ``moe_z_loss`` (token-weighted
    means over routing groups, averaged over layers; unweighted by the coefficients).
    """
    if model_cfg is None:
        values_LX = collect_local_stats(model)  # and resets them
        if values_LX is None:
            return {}
        n_exp = moe_layers(model)[0].num_experts
    else:
        ids = [i for i in range(model_cfg.n_layers) if model_cfg.is_moe_layer(i)]
        if not ids:
            return {}
        n_exp, device = model_cfg.num_experts, groups[0].device
        values_LX = torch.zeros(len(ids), 2 * n_exp + 5, dtype=torch.float64, device=device)
        for row, i in enumerate(ids):
            if str(i) in model.layers:
                values_LX[row] = collect_local_stats(model.layers[str(i)])[0].to(device)
    for group in groups:
        comm.all_reduce(values_LX, group)  # float64 counters: exact sums
    return format_stats(values_LX, n_exp)
