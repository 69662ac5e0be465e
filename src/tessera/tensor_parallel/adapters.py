"""LoRA adapters on tensor-parallel layers: a dense layer's adapter cut to match the parallel weight.

A layer built from an adapted dense linear (``tessera.lora.LoRALinear``: A [r, I], B [O, r]) keeps its
adapter under the same names (``lora_A.weight``, ``lora_B.weight``), each factor cut to the block of the
dense factor the layer's weight needs, its values taken with ``tessera.models.init.assign`` (on the meta
device: only their origin), so each rank's slice equals one process's. Every layer computes the adapter
with ``tessera.lora.lora_delta`` on the same local input its weight sees; where it adds the result and
which factor's gradient must be summed over which ranks is stated in each layer's docstring:

    layer                 A held               B held                 gradient summed over
    ColumnParallelLinear  whole [r, I]         rows [O/N, r]          A: tp (``copy_to``)
    RowParallelLinear     columns [r, I/N]     whole [O, r]           B: tp (``copy_to``)
    Linear2D (block j)    columns j [r, I/q]   rows j [O/q, r]        both: col × depth (the bias's replicas)
    Linear3D (a, c)       columns c [r, I/q]   rows a [O/q, r]        A: gather × weight; B: weight × reduce

Under the grids a factor block shared by several ranks is held once, split by rows over them
(``nd/replicas.py``), like a q/k/v bias. Legend: r adapter rank, I in features, O out features, N tp size,
q grid side.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.models.init import assign


class AdapterFactor(nn.Module):
    """One factor of a split adapter: ``weight`` is the rectangle of the single-process factor (shape
    ``global_shape``) that starts at ``offsets``; :meth:`region` names it, as the grid layers' do, for
    checkpoints. Never called; ``lora_delta`` reads its weight."""

    def __init__(self, local: torch.Tensor, global_shape: tuple[int, ...], offsets: tuple[int, ...],
                 sharded: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local.shape, dtype=local.dtype, device=local.device))
        if sharded:  # ranks hold different slices: the job-wide norm counts each once
            self.weight.tensor_parallel_sharded = True
        self.global_shape, self.offsets = tuple(global_shape), tuple(offsets)
        with torch.no_grad():
            assign(self.weight, local)

    def region(self, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.global_shape, self.offsets

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)} of {self.global_shape} at {self.offsets}"


def attach_adapter(layer: nn.Module, dense: nn.Module, a: torch.Tensor, a_offsets: tuple[int, int], a_sharded: bool,
                   b: torch.Tensor, b_offsets: tuple[int, int], b_sharded: bool) -> None:
    """Give ``layer`` the adapter of ``dense`` cut to ``a`` (a view of dense A [r, I] starting at
    ``a_offsets``) and ``b`` (a view of dense B [O, r] at ``b_offsets``); ``*_sharded``: whether the ranks
    of the layer's group hold different pieces of that factor."""
    layer.lora_A = AdapterFactor(a, tuple(dense.lora_A.weight.shape), a_offsets, a_sharded)
    layer.lora_B = AdapterFactor(b, tuple(dense.lora_B.weight.shape), b_offsets, b_sharded)
    layer.lora_dropout = dense.lora_dropout
    layer.lora_scale = dense.lora_scale
    layer.lora_A.weight.requires_grad_(dense.lora_A.weight.requires_grad)
    layer.lora_B.weight.requires_grad_(dense.lora_B.weight.requires_grad)



def frozen_names(model: nn.Module) -> set[str]:
    """Qualified names of ``model``'s frozen parameters (a LoRA job's base weights), before a split."""
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def refreeze(model: nn.Module, names: set[str]) -> None:
    """Freeze again the parameters named ``names``: the parallel layers that replaced the dense ones made
    new Parameters under the same names, which start trainable."""
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
