"""A rank's model and optimizer state as checkpoint pieces, under any layout the trainer builds.

Names (single-process, see :mod:`tessera.checkpoint.placement`)::

    model/<param>                  the parameter (fp32 master values when the run keeps masters)
    optim/<param>/exp_avg          AdamW / Adam state, the parameter's global shape
    optim/<param>/exp_avg_sq       (SGD with momentum: momentum_buffer; Adagrad: sum)
    optim/<param>/step             0-d (none for SGD)

Where the values live:

- no engine (plain, DDP, CP, TP(+SP), EP, pipeline stages): each local parameter and its optimizer state
  are held whole in local shape; the placement maps them into the global tensor (replicas on dp ranks are
  identical pieces, which the store writes once);
- ZeRO-1/2 (:class:`ZeroDataParallel`, also stage 0 = master weights for mixed precision): each bucket is
  a flat buffer of several parameters; this rank's fp32 master slice and its optimizer state cover a flat
  range of the bucket, which crosses parameters: each parameter's share is cut into rectangles
  (:func:`flat_boxes`) and mapped through the parameter's placement;
- ZeRO-3 (:class:`FullyShardedDataParallel`): the same per :class:`FlatParam` (a unit's parameters);
- ZeRO-0/1/2/3 × ep (:class:`tessera.moe.ExpertZeroDataParallel`): its two engines' buckets (dense over dp,
  experts over edp), each as above; the placement gives experts their global index.

Frozen parameters (a LoRA job's base weights, ``requires_grad`` False) are not part of the training
state: they are never saved or loaded. Their values are the job's initial values (``model.hf`` or the
seed), which a resumed job builds again, so a LoRA checkpoint holds the adapters and their optimizer state
only. A sharded engine lists trainable parameters only in ``flat_shards`` (it holds no master or state for
frozen ones); a frozen name there is skipped too.

Every piece's tensor is a view of live storage, so a load writes straight into the parameters, masters and
optimizer state; :func:`finish_load` then refreshes what is derived from them (compute-dtype copies,
gathered parameters). With disk offload (``zero.offload = "disk"``) the masters and the AdamW state are
views of memory-mapped files: the pieces are the same (the checkpoint format does not depend on where the
state lived, so either run resumes the other's checkpoint), a load writes into the files' pages and
:func:`finish_load` writes them back and unmaps them. A resume reads the checkpoint, never the offload
files, which are a fresh scratch folder in every run.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.checkpoint.pieces import Piece
from tessera.checkpoint.placement import Placer, flat_boxes
from tessera.zero import FullyShardedDataParallel
from tessera.zero.offload import StreamedAdamW, on_disk, refresh_mirror
from tessera.zero.offload.adamw import optimizer_kind, state_keys


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state a first step would (zeros, step 0) for every parameter that has none, so a
    checkpoint can be loaded into it in place: Adam/AdamW (step, exp_avg, exp_avg_sq), SGD with momentum
    (momentum_buffer; dampening 0, so 0·momentum + grad is torch's first-step copy of the gradient) and
    Adagrad (which creates its step and sum when built). Taking a step from it gives the same result as
    from a fresh optimizer. The key names are :func:`state_keys`' (one list for this and disk offload)."""
    if isinstance(optimizer, StreamedAdamW):  # disk offload: the state of file-backed masters in files too
        optimizer.ensure_state()
        return
    try:
        kind = optimizer_kind(optimizer)
    except TypeError:
        raise TypeError(f"checkpoint pieces know Adam/AdamW, SGD and Adagrad state, not "
                        f"{type(optimizer).__name__}") from None
    if kind == "adagrad":
        return
    for group in optimizer.param_groups:
        keys = state_keys(kind, group)
        if not keys:
            continue  # plain SGD keeps no state (and gets no empty entry in optimizer.state)
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            if kind == "adam":  # torch keeps a capturable / fused step on the parameter's device
                on_device = group.get("capturable", False) or group.get("fused", False)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            for key in keys:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_pieces(core: nn.Module, optimizer: torch.optim.Optimizer | None, topology=None,
                 engine=None) -> list[Piece]:
    """Every piece of model and optimizer state this rank holds (views of live tensors).

    ``core`` is the unwrapped model this rank holds (the tensor-/expert-parallel Transformer, or a
    pipeline's ``PipelineStep.module``), ``optimizer`` the one that steps it (an engine's own optimizer
    over master shards), ``engine`` a ZeRO engine or None. ``topology`` is accepted for symmetry with the
    trainer; the placements read the groups the layers and engines were built with. No communication.
    """
    if optimizer is not None:  # None: the model's pieces only (no engine)
        ensure_optimizer_state(optimizer)
    placer = Placer(core)
    if engine is None:
        return _whole_pieces(core, optimizer, placer)
    frozen = {n for n, p in core.named_parameters() if not p.requires_grad}
    pieces = []  # every sharded engine lists its flat master slices: ZeRO-1/2/3, and both parts under ep
    for master, rank, entries in engine.flat_shards():
        entries = [e for e in entries if e[0] not in frozen]
        pieces += _flat_shard_pieces(master, rank, entries, optimizer.state[master], placer)
    return pieces


def _whole_pieces(core: nn.Module, optimizer: torch.optim.Optimizer | None, placer: Placer) -> list[Piece]:
    """Each local trainable parameter and its state, held whole in local shape."""
    pieces = []
    for name, p in core.named_parameters():
        if not p.requires_grad:
            continue  # frozen: rebuilt from the job's initial values, never saved (module doc)
        where = placer.place(name, p.shape)
        pieces.append(where.piece(f"model/{where.name}", p.detach()))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                key = f"optim/{where.name}/{key}"
                pieces.append(Piece.whole(key, value) if value.dim() == 0 else where.piece(key, value))
    return [x for x in pieces if x is not None]


def _flat_shard_pieces(master: torch.Tensor, rank: int, entries: list[tuple[str, tuple, int]], state: dict,
                       placer: Placer) -> list[Piece]:
    """Pieces of one flat buffer's shard: ``master`` [n] holds flat elements [rank·n, (rank+1)·n) of a
    buffer in which each entry (local name, local shape, offset) is laid C-contiguously from its offset;
    the state tensors of ``state`` are [n] like the master, except 0-d ones (step), held whole."""
    n = master.numel()
    lo, hi = rank * n, (rank + 1) * n
    flats = {"": master.detach()}  # checkpoint-name suffix → [n] tensor: "" is the model itself
    flats.update({f"/{key}": v for key, v in state.items() if isinstance(v, torch.Tensor) and v.dim()})
    scalars = {key: v for key, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
    pieces = []
    for local_name, shape, offset in entries:
        a, b = max(offset, lo), min(offset + math.prod(shape), hi)
        if a >= b:
            continue  # none of this parameter lies in this rank's shard
        where = placer.place(local_name, shape)
        for start, box in flat_boxes(shape, a - offset, b - offset):
            at, size = offset + start - lo, math.prod(box[1])  # the rectangle's data in the shard
            for suffix, flat in flats.items():
                key = f"optim/{where.name}{suffix}" if suffix else f"model/{where.name}"
                pieces.append(where.piece(key, flat[at:at + size].view(box[1]), box))
        pieces += [Piece.whole(f"optim/{where.name}/{key}", v) for key, v in scalars.items()]
    return [x for x in pieces if x is not None]


@torch.no_grad()
def finish_load(core: nn.Module, optimizer: torch.optim.Optimizer, engine=None) -> None:
    """After pieces were loaded in place: copy fp32 masters into the compute-dtype shards where they are
    separate, then re-gather ZeRO-1/2 parameters (an all-gather per bucket over the shard group: every
    rank calls this) or drop ZeRO-3's gathered copies (the next forward gathers the loaded values).
    Nothing to do without an engine: the pieces were the parameters themselves."""
    if engine is None:
        return
    for shard in engine.update.shards:
        if on_disk(shard.master):  # chunk by chunk, each unmapped once copied
            refresh_mirror(shard.master)
        elif shard.master.data_ptr() != shard.param.data_ptr():
            shard.param.copy_(shard.master.detach())
    if isinstance(optimizer, StreamedAdamW):  # the load wrote into the mapped state: to the files, unmapped
        optimizer.settle()
    if isinstance(engine, FullyShardedDataParallel):
        for unit in engine.units:
            unit.reshard()
    else:
        engine.gather_params()
