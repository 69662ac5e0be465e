"""The optimizer of the ``[optim]`` section: AdamW (default), Adam with L2 weight decay, SGD (momentum,
Nesterov) or Adagrad, built by :func:`optimizer_factory` for every path (plain, DDP, the ZeRO and
master-weight engines over their shards, pipeline stages, offload). Weight decay acts on matrices only
(:func:`param_groups`): decoupled for AdamW, added to the gradient (L2) for the others, as torch's classes do.
The learning-rate schedules live in :mod:`tessera.train.schedules`; ``grad_clip`` is applied by
``tessera.grad_norm.clip_grad_norm``, the one job-wide clipping rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessera.errors import ConfigError
from tessera.train.schedules import build_scheduler, check_schedule, lr_factor

OPTIMIZERS = ("adamw", "adam", "sgd", "adagrad")
__all__ = ["OPTIMIZERS", "OptimConfig", "build_optimizer", "build_scheduler", "kernel_flags", "lr_factor",
           "optimizer_factory", "param_groups"]


@dataclass
class OptimConfig:
    lr: float = 2e-3  # peak learning rate, reached at the end of warm-up
    min_lr_ratio: float = 0.1  # cosine, linear and wsd decay to lr × min_lr_ratio at the schedule's last step
    warmup_steps: int = 30
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only, never to norms or biases
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    name: str = "adamw"  # the optimizer: "adamw", "adam" (L2 decay added to the gradient), "sgd", "adagrad"
    momentum: float = 0.0  # sgd: momentum (0: plain SGD)
    nesterov: bool = False  # sgd: Nesterov momentum (needs momentum > 0)
    # lr schedule after warm-up: "cosine" (to lr × min_lr_ratio), "linear" (to lr × min_lr_ratio), "constant",
    # "wsd" (warm-up, stable, then a linear decay to lr × min_lr_ratio over the last decay_fraction of the steps)
    # or DeepSpeed's, step for step as its engine applies them: "deepspeed-warmup" (WarmupLR),
    # "deepspeed-warmup-decay" (WarmupDecayLR), "deepspeed-warmup-cosine" (WarmupCosineLR); see schedules.py
    schedule: str = "cosine"
    warmup_type: str = "linear"  # warm-up shape: "linear" or "log" (DeepSpeed's WarmupLR default)
    warmup_min_ratio: float = 0.0  # the warm-up starts at lr × warmup_min_ratio
    decay_fraction: float = 0.2  # wsd: share of the schedule's steps spent decaying
    total_steps: int = 0  # steps the schedule spans (0: train.steps); past it the lr stays at its last value

    def validate(self) -> OptimConfig:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps, optim.grad_clip and optim.weight_decay must not be negative")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"optim.beta1 and optim.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name={self.name!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
        if self.eps <= 0 or not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.eps must be positive and optim.momentum in [0, 1), got {self.eps}, "
                              f"{self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("optim.nesterov=true needs optim.momentum > 0 (Nesterov looks ahead along the momentum)")
        check_schedule(self)
        return self


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Trainable parameters in two groups: weight decay on tensors of 2 or more dims, none on the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def kernel_flags(kernel: str) -> dict:
    """The implementation arguments ``[kernels] adamw`` passes to the optimizer class (torch's AdamW, Adam,
    SGD and Adagrad all take them, on CPU and CUDA): "auto" passes none (torch picks: the for-loop on CPU,
    foreach on CUDA), the others force theirs. Same update, different rounding."""
    return {"auto": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True},
            "fused": {"fused": True}}[kernel]


def optimizer_factory(cfg: OptimConfig, kernel: str = "auto"):
    """``make(param_groups) -> torch optimizer`` of ``cfg.name``: how a sharded engine builds the optimizer
    over its master shards (each group carries its weight_decay); ``kernel`` is ``[kernels] adamw``."""
    flags = kernel_flags(kernel)
    if cfg.name == "adamw":
        return lambda groups: torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                                **flags)
    if cfg.name == "adam":  # DeepSpeed's Adam with adam_w_mode=false: weight decay joins the gradient (L2)
        return lambda groups: torch.optim.Adam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                               **flags)
    if cfg.name == "sgd":  # dampening 0: a zero momentum buffer steps exactly like torch's first-step copy
        return lambda groups: torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                                              **flags)
    return lambda groups: torch.optim.Adagrad(groups, lr=cfg.lr, eps=cfg.eps, **flags)


def build_optimizer(model: nn.Module, cfg: OptimConfig, kernel: str = "auto") -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` over ``model``'s trainable parameters; weight decay on tensors of 2 or more dims."""
    return optimizer_factory(cfg, kernel)(param_groups(model, cfg))
