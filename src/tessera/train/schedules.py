"""Learning-rate schedules (``[optim]`` schedule, warmup_*, min_lr_ratio, decay_fraction, total_steps).

Every schedule is a multiplier of ``optim.lr`` for optimizer step ``k`` (0-based) over a span of ``T`` steps
(``optim.total_steps``, or ``train.steps`` when 0), in two parts:

- **warm-up** (``k < W``, ``W = optim.warmup_steps``): from ``m = optim.warmup_min_ratio`` to 1,
  ``m + (1 - m) · g`` with ``g = (k + 1) / W`` ("linear") or ``g = ln(k + 2) / ln(W)`` capped at 1 ("log");
- **after it** (``k ≥ W``; ``r = optim.min_lr_ratio``):

  ========  =====================================================================================
  constant  1
  linear    ``r + (1 - r) · max(0, (T - 1 - k) / (T - W))``: 1 at the warm-up's end, ``r`` at step T - 1
  cosine    ``r + (1 - r) · (1 + cos(π p)) / 2``, ``p = min(1, (k - W) / (T - W - 1))``: 1 at step W,
            ``r`` at step T - 1 (tessera's schedule since the start, unchanged)
  wsd       warm-up, stable at 1, then ``r + (1 - r) · min(1, (T - 1 - k) / D)`` over the last
            ``D = max(1, round(decay_fraction · T))`` steps: ``r`` at step T - 1
  ========  =====================================================================================

  Past step T - 1 each stays at its last value. Denominators are at least 1.

DeepSpeed's schedulers, as its engine applies them, are three more schedules (``deepspeed-warmup``,
``deepspeed-warmup-decay``, ``deepspeed-warmup-cosine``: WarmupLR, WarmupDecayLR, WarmupCosineLR, what
``tessera train --deepspeed`` maps them to). DeepSpeed's engine steps its scheduler after each applied
optimizer step and never before the first (runtime/engine.py ``_take_model_step``), so its optimizer step
``k`` runs at the lr of scheduler iteration ``i = k - 1``; step 0 at the lr the scheduler's constructor sets
(iteration -1: WarmupLR's ``warmup_min_lr``, WarmupCosineLR's 0). With ``m = warmup_min_ratio``,
``r = min_lr_ratio``, ``W = warmup_steps`` (at least 2, DeepSpeed's floor) and ``T`` the span:

- warm-up, ``0 <= i < W``: ``m + γ (1 - m)``, ``γ = i / W`` ("linear") or ``ln(i + 1) / ln(W)`` ("log");
- after it: ``deepspeed-warmup`` 1; ``deepspeed-warmup-decay`` ``r + (1 - r) max(0, (T - i) / max(1, T - W))``
  (``r`` from iteration T on); ``deepspeed-warmup-cosine`` ``max(0, r + (1 - r) (1 + cos(π p)) / 2)`` with
  ``p = min(1, (i - W + 1) / max(1, T - W))``.

The expressions are DeepSpeed's, in its order: WarmupCosineLR's lr is bit for bit DeepSpeed's; WarmupLR's and
WarmupDecayLR's are too with ``warmup_min_lr = 0`` (DeepSpeed adds ``warmup_min_lr + Δ γ``; tessera multiplies
the peak by a ratio, equal to within an ulp otherwise). ``cosine``, ``linear`` and ``constant`` with a linear
or log warm-up give WarmupLR's / WarmupDecayLR's formulas at ``i = k + 1`` (two steps ahead of DeepSpeed's
engine); ``cosine``'s decay is not WarmupCosineLR's (tests/test_lr_schedules.py checks all of this).
"""

from __future__ import annotations

import math

import torch

DEEPSPEED = ("deepspeed-warmup", "deepspeed-warmup-decay", "deepspeed-warmup-cosine")
SCHEDULES = ("cosine", "linear", "constant", "wsd", *DEEPSPEED)
WARMUP_TYPES = ("linear", "log")


def warmup_fraction(step: int, cfg) -> float:
    """The warm-up's multiplier at step ``step`` < ``cfg.warmup_steps``: ``warmup_min_ratio`` → 1."""
    if cfg.warmup_type == "log":
        g = min(1.0, math.log(step + 2) / math.log(cfg.warmup_steps))
    else:
        g = (step + 1) / cfg.warmup_steps
    m = cfg.warmup_min_ratio
    return m + (1.0 - m) * g  # m = 0 gives g exactly: (k + 1) / W, the multiplier tessera always used


def decay_fraction(step: int, cfg, span: int) -> float:
    """The multiplier after the warm-up (step ≥ ``cfg.warmup_steps``) of a schedule spanning ``span`` steps."""
    w, r = cfg.warmup_steps, cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "linear":
        return r + (1.0 - r) * max(0.0, (span - 1 - step) / max(span - w, 1))
    if cfg.schedule == "wsd":
        decay = max(1, round(cfg.decay_fraction * span))
        return r + (1.0 - r) * min(1.0, max(0.0, (span - 1 - step) / decay))
    progress = min((step - w) / max(span - w - 1, 1), 1.0)  # cosine (the expressions of old, bit for bit)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return r + (1.0 - r) * cosine


def deepspeed_factor(step: int, cfg, span: int) -> float:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (``cfg.schedule`` in :data:`DEEPSPEED`) at
    optimizer step ``step`` as DeepSpeed's engine applies it: scheduler iteration ``step - 1``."""
    i, w, m, r = step - 1, cfg.warmup_steps, cfg.warmup_min_ratio, cfg.min_lr_ratio
    cosine = cfg.schedule == "deepspeed-warmup-cosine"
    if i < 0:  # the lr the scheduler's constructor sets before its first step ("before it has started")
        return 0.0 if cosine else m
    if i < w:  # lr_schedules.py's gamma, in its order: inverse_log_warm_up * log(i + 1), or i / W
        gamma = (1.0 / math.log(w)) * math.log(i + 1) if cfg.warmup_type == "log" else i / w
        return m + gamma * (1.0 - m)
    if cfg.schedule == "deepspeed-warmup":
        return m + 1.0 * (1.0 - m)
    if not cosine:  # WarmupDecayLR
        return r + max(0.0, float(span - i) / float(max(1.0, span - w))) * (1.0 - r)
    progress = min(1.0, (i - w + 1) / max(1, span - w))
    return max(0.0, r + (1.0 - r) * ((1 + math.cos(math.pi * progress)) / 2))


def lr_factor(step: int, cfg, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` (an OptimConfig) for optimizer step ``step`` (0-based); ``total_steps`` is
    the run's length, the schedule's span unless ``cfg.total_steps`` sets it."""
    if cfg.schedule in DEEPSPEED:
        return deepspeed_factor(step, cfg, cfg.total_steps or total_steps)
    if step < cfg.warmup_steps:
        return warmup_fraction(step, cfg)
    return decay_fraction(step, cfg, cfg.total_steps or total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    """A LambdaLR stepping ``optimizer``'s groups along :func:`lr_factor` (``cfg`` an OptimConfig)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))


def check_schedule(cfg) -> None:
    """Raise ConfigError (one sentence) for schedule settings of OptimConfig ``cfg`` no schedule can use."""
    from tessera.errors import ConfigError

    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if cfg.warmup_type not in WARMUP_TYPES:
        raise ConfigError(f"optim.warmup_type={cfg.warmup_type!r} is unknown; use linear or log")
    if cfg.schedule in DEEPSPEED and cfg.warmup_steps < 2:
        raise ConfigError(f"optim.schedule={cfg.schedule!r} needs optim.warmup_steps >= 2 (DeepSpeed raises "
                          f"warmup_num_steps to at least 2), got {cfg.warmup_steps}")
    if cfg.warmup_type == "log" and cfg.warmup_steps == 1:  # 0: no warm-up (settings.py refuses the key)
        raise ConfigError(f"optim.warmup_type='log' needs optim.warmup_steps >= 2 (it divides by ln(warmup_steps)), "
                          f"got {cfg.warmup_steps}")
    if not 0 <= cfg.warmup_min_ratio <= 1:
        raise ConfigError(f"optim.warmup_min_ratio must be in [0, 1], got {cfg.warmup_min_ratio}")
    if not 0 < cfg.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction must be in (0, 1], got {cfg.decay_fraction}")
    if cfg.total_steps < 0:
        raise ConfigError(f"optim.total_steps must be 0 (train.steps) or positive, got {cfg.total_steps}")
