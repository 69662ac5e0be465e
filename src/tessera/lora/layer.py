"""LoRA on one device: the adapted linear layer, and putting adapters on a (meta-built) model.

``LoRALinear`` is an ``nn.Linear`` whose frozen ``weight`` (and ``bias``) keep their names, with two
submodules ``lora_A`` (weight A [r, in]) and ``lora_B`` (weight B [out, r]), named as PEFT names them, so an
adapter's tensors are ``<linear>.lora_A.weight`` / ``<linear>.lora_B.weight``:

    y = x Wᵀ (+ b) + scale · (dropout(x) Aᵀ) Bᵀ,   scale = alpha / r

A ~ N(0, (1/r)²) (PEFT's "gaussian" initialisation) and B = 0 at the start, so the
adapted model starts equal to the base model. Both are drawn like every initial value in tessera, from
(seed, whole-model name) (``tessera.models.init``), so every layout starts from the same adapter.

Parallel layers that take a dense linear (``from_dense``) keep its adapter, split to match their own
weight (``tessera.lora`` docs); :func:`lora_delta` is the one adapter computation they all call.
Legend: I in features, O out features, r rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.lora.config import LoRAConfig
from tessera.models.init import InitSpec, init_parameter

ADAPTER_PARTS = ("lora_A", "lora_B")


def is_adapter_name(name: str) -> bool:
    """Whether parameter ``name`` (any qualified name) belongs to a LoRA adapter."""
    parts = name.split(".")
    return any(p in ADAPTER_PARTS for p in parts)


def make_adapter(module: nn.Module, in_features: int, out_features: int, cfg: LoRAConfig,
                 device: torch.device | None = None) -> None:
    """Give ``module`` the adapter submodules of an [out, in] weight: lora_A (A [r, in]), lora_B (B [out, r]),
    lora_dropout, and the float ``lora_scale``. Their values are set by the caller (init or assign)."""
    module.lora_A = nn.Linear(in_features, cfg.rank, bias=False, device=device)
    module.lora_B = nn.Linear(cfg.rank, out_features, bias=False, device=device)
    module.lora_dropout = nn.Dropout(cfg.dropout)
    module.lora_scale = cfg.scale


def has_adapter(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lora_A", None), nn.Module)


def lora_delta(module: nn.Module, x: torch.Tensor, a: torch.Tensor | None = None, b: torch.Tensor | None = None,
               mid=None) -> torch.Tensor:
    """scale · B A dropout(x): x [.., I] → [.., O] with the module's own (local) A [r, I] and B [O, r].

    A parallel layer passes ``a`` / ``b`` in place of the module's own factors when they first go through a
    collective's autograd (a replicated factor whose gradient is summed over tp, a block gathered over its
    replicas), and ``mid`` (h [.., r] → h) when the low-rank activation itself must be reduced."""
    h = F.linear(module.lora_dropout(x), module.lora_A.weight if a is None else a)  # [.., r]
    if mid is not None:
        h = mid(h)
    return F.linear(h, module.lora_B.weight if b is None else b) * module.lora_scale


class LoRALinear(nn.Linear):
    """A linear layer with a low-rank adapter (module doc). Forward: one device, no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: LoRAConfig,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        make_adapter(self, in_features, out_features, cfg, device)

    @classmethod
    def wrap(cls, linear: nn.Linear, cfg: LoRAConfig) -> LoRALinear:
        """An adapted layer holding ``linear``'s own weight and bias Parameters (their origins and marks
        kept), with a fresh adapter whose values are not yet set."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, cfg,
                  device=linear.weight.device, dtype=linear.weight.dtype)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + lora_delta(self, x)


def add_lora(model: nn.Module, cfg: LoRAConfig, seed: int) -> list[str]:
    """Put an adapter on every ``nn.Linear`` of ``model`` whose last name component is in ``cfg.targets``
    (on the whole model, before any strategy cuts it; the meta device is fine), give each adapter its
    initial values from (``seed``, its whole-model name), or from the PEFT adapter ``cfg.init_from``
    (``tessera.lora.peft``), and freeze every other parameter. Returns the
    qualified names of the adapted layers, in module order."""
    cfg.validate()
    if not cfg.enabled:
        return []
    adapted = []
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] not in cfg.targets or type(module) is not nn.Linear:
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = LoRALinear.wrap(module, cfg)
        init_parameter(new.lora_A.weight, InitSpec(f"{name}.lora_A.weight", tuple(new.lora_A.weight.shape),
                                                   "normal", 1.0 / cfg.rank, seed=seed))
        init_parameter(new.lora_B.weight, InitSpec(f"{name}.lora_B.weight", tuple(new.lora_B.weight.shape),
                                                   "zeros", 0.0, seed=seed))
        setattr(parent, leaf, new)
        adapted.append(name)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    if cfg.init_from:  # a PEFT adapter's values instead, read where each rank's slice will lie
        from tessera.lora.peft import attach_peft

        attach_peft(model, cfg.init_from, cfg)
    return adapted


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter parameters of ``model`` by qualified name (the trainable ones of a LoRA job)."""
    return {n: p for n, p in model.named_parameters() if is_adapter_name(n)}
