"""Activation checkpointing of transformer blocks with ``torch.utils.checkpoint`` (non-reentrant).

    full       a checkpointed block keeps only its input; its whole forward is recomputed in backward
    selective  a checkpointed block also keeps the outputs of its matmuls and attention kernels
               (torch's selective-checkpoint policy, ``create_selective_checkpoint_contexts``); the
               cheap element-wise work (norms, RoPE, SwiGLU gate, reshapes) is recomputed
    every = k  only blocks 0, k, 2k, … are checkpointed

The model is not edited: each chosen block's *instance* ``forward`` is replaced by a checkpointed call
of the original, so module names, state dicts and hooks (ZeRO-3 gathers its parameters in a
pre-forward hook, outside the checkpoint) stay as they were. In backward the recomputation reads the
block's parameters through the same attributes, which ZeRO-3 has gathered again for the backward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from tessera.recompute.config import RecomputeConfig

_aten = torch.ops.aten
# Outputs kept by the selective policy: the expensive ops; everything else is recomputed.
SAVE_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Held(torch.autograd.Function):
    """Identity on ``x`` that declares ``held`` as saved for backward. What a checkpoint keeps (its
    inputs, the selective policy's cached outputs) never passes the saved-tensor hooks outside it;
    this makes the MemoryLedger's activation count see them. No memory is added: they are alive anyway."""

    @staticmethod
    def forward(ctx, x, *held):
        ctx.save_for_backward(*held)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *[None] * len(ctx.saved_tensors))


def _checkpointed(original, mode: str, *args, **kwargs):
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    contexts = []

    def context_fn():
        contexts.append(create_selective_checkpoint_contexts(_selective_policy))
        return contexts[-1]

    extra = {"context_fn": context_fn} if mode == "selective" else {}
    # no early stop: the recomputation must run the block to its end, so that forward hooks inside it
    # (a tensor-parallel region's exit, which pops its saved-tensor hooks) run as they did in forward
    with set_checkpoint_early_stop(False):
        out = checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    # the selective policy's cache: {op key: {call index: output tree of _VersionWrapper}}
    cached = [t for ctx in contexts[:1] for calls in getattr(ctx[0], "storage", {}).values()
              for t in _tensors(calls)]
    return _Held.apply(out, *inputs, *cached) if isinstance(out, torch.Tensor) else out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(getattr(tree, "val", None), torch.Tensor):
        yield tree.val
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)


def apply_checkpointing(blocks: list[nn.Module], cfg: RecomputeConfig) -> list[nn.Module]:
    """Checkpoint every ``cfg.every``-th of ``blocks`` (in order) in ``cfg.mode``; returns those changed."""
    if cfg.mode == "none":
        return []
    chosen = blocks[:: cfg.every]
    for block in chosen:
        block.forward = functools.partial(_checkpointed, block.forward, cfg.mode)
    return chosen


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a tessera Transformer in order (``model.layers``)."""
    return list(model.layers.values())
