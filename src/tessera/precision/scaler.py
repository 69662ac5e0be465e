"""Dynamic loss scaling for fp16: multiply the loss by S so small gradients survive in fp16; divide the
gradients by S before the update. On inf/nan anywhere (on any rank) the step is skipped and S halved;
after ``growth_interval`` clean steps in a row S doubles. Every skipped step is counted, never silent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 65536.0  # the current S; 1.0 with a static no-op scaler
    dynamic: bool = True
    growth_interval: int = 200
    min_scale: float = 1.0
    clean_steps: int = 0  # finite steps since the last change
    skipped: int = 0  # steps skipped over the whole run

    @classmethod
    def from_config(cls, cfg) -> LossScaler:
        """A scaler for a PrecisionConfig: dynamic for fp16 ("auto"), else static."""
        mode = cfg.loss_scale
        if mode == "auto":
            mode = "dynamic" if cfg.dtype == "fp16" else "none"
        if mode == "dynamic":
            return cls(scale=cfg.init_scale, dynamic=True, growth_interval=cfg.growth_interval)
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
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return False
        self.clean_steps += 1
        if self.dynamic and self.clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}
