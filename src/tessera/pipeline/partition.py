"""Split a model's layers into pipeline stages, and cut the reference Transformer into stage modules.

Stages are contiguous runs of layers in model order. Balancing minimises the largest stage cost (linear
partition by dynamic programming), where a layer's cost is its parameter count, 1 (uniform), or a given
measured / estimated cost; the embeddings count towards the first stage and the head towards the last.
An explicit per-stage list must use every layer exactly once, in order, or the user gets a ConfigError.
"""

from __future__ import annotations

import copy

from torch import nn

from tessera.errors import ConfigError
from tessera.models.init import copy_origins


def balanced_partition(costs: list[float], n_stages: int, first_extra: float = 0.0,
                       last_extra: float = 0.0) -> list[list[int]]:
    """Contiguous split of layers 0..L-1 into ``n_stages`` non-empty stages minimising the max stage cost."""
    n = len(costs)
    if n_stages > n:
        raise ConfigError(f"cannot split {n} layers into {n_stages} pipeline stages: each stage needs a layer.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds layers i..j-1
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: smallest max cost of stages 0..s covering layers 0..j-1; cut[s][j] where stage s starts.
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], cost(s, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    bounds, j = [], n
    for s in range(n_stages - 1, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return [list(range(i, j)) for i, j in reversed(bounds)]


def check_explicit(layers: list[list[int]], n_layers: int) -> list[list[int]]:
    """Every layer exactly once, stages non-empty and in model order; else one ConfigError sentence."""
    flat = [i for stage in layers for i in stage]
    missing = sorted(set(range(n_layers)) - set(flat))
    dup = sorted({i for i in flat if flat.count(i) > 1})
    unknown = sorted(i for i in set(flat) if not 0 <= i < n_layers)
    if missing or dup or unknown:
        raise ConfigError(f"pipeline.layers must assign each of the {n_layers} layers exactly once "
                          f"(missing {missing}, repeated {dup}, unknown {unknown}).")
    if any(not stage for stage in layers):
        raise ConfigError("pipeline.layers has an empty stage; every stage needs at least one layer.")
    if flat != list(range(n_layers)):
        raise ConfigError(f"pipeline.layers must list contiguous layers in model order, got {layers}.")
    return [list(s) for s in layers]


def partition_transformer(model: nn.Module, n_stages: int, method: str = "params",
                          explicit: list[list[int]] | None = None,
                          layer_costs: list[float] | None = None) -> list[list[int]]:
    """Layer indices per stage for the reference Transformer (``tok_embeddings``, ``layers``, ``output``)."""
    n = len(model.layers)
    if n_stages > n:
        raise ConfigError(f"pipeline has {n_stages} stages but the model has only {n} layers; lower pp "
                          f"(or virtual_stages) to at most {n}.")
    if method == "explicit":
        return check_explicit(explicit or [], n)
    if method == "uniform":
        return balanced_partition([1.0] * n, n_stages)
    if method == "cost":
        if layer_costs is None or len(layer_costs) != n:
            raise ConfigError(f"partition 'cost' needs one cost per layer ({n}), got {layer_costs}.")
        return balanced_partition([float(c) for c in layer_costs], n_stages)
    if method != "params":
        raise ConfigError(f"unknown partition method '{method}'; use params, uniform, cost or explicit.")
    costs = [float(sum(p.numel() for p in model.layers[str(i)].parameters())) for i in range(n)]
    emb = float(model.tok_embeddings.weight.numel()) if model.tok_embeddings is not None else 0.0
    head = float(sum(p.numel() for p in model.output.parameters())) if model.output is not None else 0.0
    head += float(sum(p.numel() for p in model.norm.parameters())) if model.norm is not None else 0.0
    return balanced_partition(costs, n_stages, first_extra=emb, last_extra=head)


def build_stage(model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """A copy of ``model`` holding only ``layer_ids`` (keys kept, so parameter names match the full
    model), the embeddings only on the first stage and the norm + head only on the last. On a model built
    on the meta device the copy costs nothing and keeps each parameter's initial-value origin
    (``copy.deepcopy`` drops tensor attributes, so they are copied over by name)."""
    stage = copy.deepcopy(model)
    copy_origins(model, stage)
    keep = {str(i) for i in layer_ids}
    for key in list(stage.layers.keys()):
        if key not in keep:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def stage_modules(model: nn.Module, partition: list[list[int]], pp: int, rank: int) -> dict[int, nn.Module]:
    """The stage modules of pipeline rank ``rank``: virtual stage s lives on rank s % pp."""
    n_stages = len(partition)
    return {s: build_stage(model, partition[s], s == 0, s == n_stages - 1)
            for s in range(rank, n_stages, pp)}
