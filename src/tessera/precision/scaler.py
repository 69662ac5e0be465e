"""Dynamic loss scaling for fp16: multiply the loss by S so small gradients survive in fp16; divide the
gradients by S before the update. On inf/nan anywhere (on any rank) the step is skipped; after
``growth_interval`` clean steps in a row S doubles. Every skipped step is counted, never silent.

When an overflow halves S (never below ``min_scale``) is DeepSpeed's "delayed shift" (``hysteresis``, its
``consecutive_hysteresis=false`` default): the first ``hysteresis - 1`` overflows since S last grew (or
since the start) only use up the allowance; from then on each overflow halves S, until S grows again and
refills it. ``hysteresis = 1`` halves at every overflow. ``consecutive_hysteresis`` refills it at every
finite step instead (DeepSpeed's ``consecutive_hysteresis=true``): only ``hysteresis`` overflows in a row halve.

``growth_delay`` clean steps more are needed for the first growth after the start or an overflow than for
the next ones: DeepSpeed's ``loss_scale_window`` W grows S when the clean steps since the last overflow
(or the start) number W + 1, 2W + 1, ... (``stable_interval = cur_iter - last_overflow_iter - 1``, a positive
multiple of W), which is ``growth_interval = W`` with ``growth_delay = 1``; tessera's default 0 grows after
every ``growth_interval`` clean steps (torch's GradScaler rule).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 65536.0  # the current S; 1.0 with a static no-op scaler
    dynamic: bool = True
    growth_interval: int = 200
    min_scale: float = 1.0
    hysteresis: int = 1  # overflows (since S last grew) up to and including the first one that halves S
    clean_steps: int = 0  # finite steps since the last change
    skipped: int = 0  # steps skipped over the whole run
    overflows_left: int = -1  # the allowance left: S halves at an overflow when it is 1 (-1: hysteresis)
    consecutive_hysteresis: bool = False  # refill the allowance at every finite step, not only when S grows
    growth_delay: int = 0  # extra clean steps before the first growth after the start or an overflow

    def __post_init__(self):
        if self.overflows_left < 0:
            self.overflows_left = self.hysteresis
        if self.dynamic and self.clean_steps == 0:  # the start counts like an overflow (DeepSpeed's window)
            self.clean_steps = -self.growth_delay

    @classmethod
    def from_config(cls, cfg) -> LossScaler:
        """A scaler for a PrecisionConfig: dynamic for fp16 ("auto"), else static."""
        mode = cfg.loss_scale
        if mode == "auto":
            mode = "dynamic" if cfg.dtype == "fp16" else "none"
        if mode == "dynamic":
            return cls(scale=cfg.init_scale, dynamic=True, growth_interval=cfg.growth_interval,
                       min_scale=cfg.min_loss_scale, hysteresis=cfg.hysteresis,
                       consecutive_hysteresis=cfg.consecutive_hysteresis, growth_delay=cfg.growth_delay)
        if mode == "none":
            return cls(scale=1.0, dynamic=False)
        return cls(scale=float(mode), dynamic=False)

    @property
    def active(self) -> bool:
        """Whether losses are scaled at all (a dynamic scaler, or a fixed scale other than 1)."""
        return self.dynamic or self.scale != 1.0

    def update(self, finite: bool) -> bool:
        """Record a step's outcome; returns whether the step may be applied."""
        if not finite:
            self.skipped += 1
            self.clean_steps = -self.growth_delay
            if self.dynamic and self.overflows_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            elif self.dynamic:
                self.overflows_left -= 1
            return False
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.overflows_left = self.hysteresis
        if self.dynamic and self.clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0
            self.overflows_left = self.hysteresis
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped,
                "overflows_left": self.overflows_left}
