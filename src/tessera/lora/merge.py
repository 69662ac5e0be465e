"""Merging LoRA adapters into the base weights: ``W' = W + scale · B A`` (one process, whole model).

A merged layer is a plain ``nn.Linear`` under the adapted layer's name holding W' [O, I] (and the same
bias), so the merged model has exactly the parameters of the base model, with plain names: what
``tessera.hf.save`` writes as an ordinary Hugging Face model and what ``tessera generate`` decodes with.
For x without dropout, x W'ᵀ = x Wᵀ + scale · (x Aᵀ) Bᵀ, the adapted layer's output (up to rounding).
The product is formed in fp32 and rounded once to the weight's dtype. Legend: I in, O out, r rank.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.lora.layer import LoRALinear


@torch.no_grad()
def merged_weight(layer: LoRALinear) -> torch.Tensor:
    """W + scale · B A of one adapted layer: [O, I] in the weight's dtype (computed in fp32)."""
    delta = layer.lora_B.weight.float() @ layer.lora_A.weight.float()  # [O, r] @ [r, I] -> [O, I]
    return (layer.weight.float() + layer.lora_scale * delta).to(layer.weight.dtype)


def merge_lora(model: nn.Module) -> list[str]:
    """Replace, in place, every ``LoRALinear`` of the whole one-process ``model`` by an ``nn.Linear`` holding
    its merged weight and its bias; every parameter becomes trainable again (the model is an ordinary one).
    Returns the qualified names of the merged layers, in module order."""
    merged = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                           device=module.weight.device, dtype=module.weight.dtype)
        linear.weight = nn.Parameter(merged_weight(module))
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach())
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, linear)
        merged.append(name)
    model.requires_grad_(True)
    return merged
