"""The whole reference Transformer on a 2D / 2.5D / 3D grid, and what the training step needs to know of it.

:func:`apply_nd_tensor_parallel` replaces, in place and under the same names (so checkpoints keep the
single-process names): ``tok_embeddings`` → :class:`EmbeddingND`, each block → :class:`TransformerBlockND`,
``norm`` → :class:`NormND`, ``output`` → an "up" layer whose output is the logits [B/n_b, S, V/q],
split by vocabulary over ``layout.vocab_group`` (the vocabulary-parallel cross-entropy's group). Every
weight element is held by exactly one tp rank (``shard_replicas``), so clipping, ZeRO and checkpoints
treat every parameter as split over ``tp`` (``is_sharded``).

The tp ranks of a grid hold different tokens: a step's samples are cut into n_b batch blocks
(:func:`batch_share`), and the ranks that hold different logits rows form, with dp, the group over which
tokens and losses are summed (:func:`tokens_group`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.comm.group import CommGroup
from tessera.tensor_parallel.adapters import frozen_names, refreeze
from tessera.tensor_parallel.nd.block import Layout, Layout2D, Layout3D, NormND, TransformerBlockND
from tessera.tensor_parallel.nd.embedding import EmbeddingND
from tessera.tensor_parallel.nd.grid import Grid2D, Grid3D, _unravel


def apply_nd_tensor_parallel(model: nn.Module, tp: CommGroup, cfg, partition) -> Layout:
    """Split ``model`` (a dense Transformer, the same on every tp rank) over the grid of ``cfg.mode``
    ("2d", "2.5d" with ``cfg.depth``, "3d"); returns the layout (also ``model.nd_layout``). On the meta
    device the grid layers stay on it and only record which block of each dense weight they hold
    (``models.init.assign``), so ``models.init.materialize`` allocates just this rank's blocks. ``partition``:
    every tp group of the job (``Topology.partitions["tp"]``), since building the grid's groups is
    collective over the world."""
    if cfg.mode == "3d":
        layout = Layout3D(Grid3D.build(tp, partition), shard_replicas=True)
    else:
        layout = Layout2D(Grid2D.build(tp, partition, cfg.depth if cfg.mode == "2.5d" else 1), shard_replicas=True)
    dim, frozen = model.cfg.dim, frozen_names(model)
    model.tok_embeddings = EmbeddingND(model.tok_embeddings, layout)
    for name in list(model.layers):
        model.layers[name] = TransformerBlockND(model.layers[name], layout)
    model.norm = NormND(model.norm, layout, dim)
    model.output = layout.up(model.output)
    refreeze(model, frozen)  # LoRA: the base weights stay frozen in their grid layers
    model.tensor_parallel, model.nd_layout = (tp, cfg), layout
    return layout


def tokens_group(topology, layout: Layout) -> CommGroup:
    """The ranks whose logits hold different tokens: same pipeline stage and same vocabulary coordinate,
    any dp / cp coordinate and any other grid coordinate. Collective over the world (group creation)."""
    pp_of = {r: i for part in topology.partitions["pp"] for i, r in enumerate(part)}
    key = {}
    for part in topology.partitions["tp"]:
        for t, r in enumerate(part):
            key[r] = (pp_of[r], _unravel(t, layout.grid_shape)[layout.vocab_axis])
    parts = [tuple(r for r in sorted(key) if key[r] == k) for k in sorted(set(key.values()))]
    mine = next(p for p in parts if topology.rank in p)
    world = topology.group("world")
    pg = None
    if len(mine) > 1:
        pgs = dist.new_subgroups_by_enumeration([list(p) for p in parts], timeout=world.timeout)[1]
        pg = pgs[parts.index(mine)]
    return CommGroup("dp_tp_batch", pg, mine, topology.rank, topology.ledger, world.timeout, topology.device)


def batch_share(batches: list[tuple[torch.Tensor, torch.Tensor]], layout: Layout,
                ignore_index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of a step: the step's samples (the same on every rank of the grid) cut
    into n_b batch blocks, inputs from block ``batch_block`` and targets from ``loss_block`` (where the
    logits of those inputs' rows land; 3D: another block). Samples [T, S] are padded to a multiple of
    n_b with ``ignore_index`` targets, so every block has the same size (the grid's collectives need it)
    and neither the loss nor the token count changes. Micro-batches of max(1, B // n_b) samples, B the
    given micro-batches' size."""
    micro_batch_size = batches[0][0].shape[0]
    x_TS = torch.cat([x for x, _ in batches])
    y_TS = torch.cat([y for _, y in batches])
    n = layout.n_batch
    pad = -x_TS.shape[0] % n
    if pad:
        x_TS = torch.cat([x_TS, x_TS.new_zeros((pad, x_TS.shape[1]))])
        y_TS = torch.cat([y_TS, y_TS.new_full((pad, y_TS.shape[1]), ignore_index)])
    x_bS, y_bS = x_TS.chunk(n)[layout.batch_block], y_TS.chunk(n)[layout.loss_block]
    per = max(1, micro_batch_size // n)
    return list(zip(x_bS.split(per), y_bS.split(per)))
