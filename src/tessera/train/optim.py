"""AdamW with linear warm-up and cosine decay (the ``[optim]`` section); ``grad_clip`` is applied by
``tessera.grad_norm.clip_grad_norm``, the one job-wide clipping rule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tessera.errors import ConfigError


@dataclass
class OptimConfig:
    lr: float = 2e-3  # peak learning rate, reached at the end of warm-up
    min_lr_ratio: float = 0.1  # the cosine decays to lr × min_lr_ratio at the last step
    warmup_steps: int = 30
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only, never to norms or biases
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off

    def validate(self) -> OptimConfig:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps, optim.grad_clip and optim.weight_decay must not be negative")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"optim.beta1 and optim.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        return self


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Trainable parameters in two groups: weight decay on tensors of 2 or more dims, none on the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def adamw_flags(adamw: str) -> dict:
    """torch.optim.AdamW's implementation arguments for ``[kernels] adamw``: "auto" passes none (torch picks:
    the for-loop on CPU, foreach on CUDA), the others force theirs. Same update, different rounding."""
    return {"auto": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True},
            "fused": {"fused": True}}[adamw]


def optimizer_factory(cfg: OptimConfig, adamw: str = "auto"):
    """``make(param_groups) -> AdamW``: how a sharded engine builds the optimizer over its master shards;
    ``adamw`` is ``[kernels] adamw`` (``adamw_flags``)."""
    flags = adamw_flags(adamw)
    return lambda groups: torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                            **flags)


def build_optimizer(model: nn.Module, cfg: OptimConfig, adamw: str = "auto") -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters; weight decay on tensors of 2 or more dims."""
    return optimizer_factory(cfg, adamw)(param_groups(model, cfg))


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warm-up, then cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(total_steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))

