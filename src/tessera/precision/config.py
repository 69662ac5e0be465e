"""Configuration of mixed precision (the ``[precision]`` section)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrecisionConfig:
    dtype: str = "fp32"  # parameter/compute dtype: fp32, bf16 or fp16 (fp32 master weights when not fp32)
    reduce_dtype: str = ""  # dtype gradients are reduced in; empty: the compute dtype
    # "auto": dynamic for fp16, none otherwise; "dynamic"; "none"; or a fixed number (any layout: the loss is
    # multiplied by it and the gradients divided by it before the norm, clipping and the step)
    loss_scale: str = "auto"
    init_scale: float = 65536.0  # dynamic loss scaling: the first scale
    growth_interval: int = 200  # dynamic loss scaling: double the scale after this many clean steps
    hysteresis: int = 1  # dynamic loss scaling: overflows since the scale last grew before one halves it (DeepSpeed's)
    min_loss_scale: float = 1.0  # dynamic loss scaling: the scale never goes below this
    consecutive_hysteresis: bool = False  # dynamic: refill the hysteresis at every finite step (DeepSpeed's)
    growth_delay: int = 0  # dynamic: extra clean steps before the first growth after the start or an overflow

    def validate(self) -> PrecisionConfig:
        if self.dtype not in DTYPES:
            raise ConfigError(f"precision.dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        if self.reduce_dtype and self.reduce_dtype not in DTYPES:
            raise ConfigError(
                f"precision.reduce_dtype must be empty or one of {', '.join(DTYPES)}, got '{self.reduce_dtype}'")
        if self.loss_scale not in ("auto", "dynamic", "none"):
            try:
                if float(self.loss_scale) <= 0:
                    raise ValueError
            except ValueError:
                raise ConfigError(
                    f"precision.loss_scale must be 'auto', 'dynamic', 'none' or a positive number, "
                    f"got '{self.loss_scale}'") from None
        if self.init_scale <= 0 or self.growth_interval < 1:
            raise ConfigError("precision.init_scale must be positive and precision.growth_interval at least 1")
        if self.hysteresis < 1:
            raise ConfigError(f"precision.hysteresis must be at least 1 (1 halves the scale at every overflow), "
                              f"got {self.hysteresis}")
        if self.growth_delay < 0:
            raise ConfigError(f"precision.growth_delay must not be negative, got {self.growth_delay}")
        if not 0 < self.min_loss_scale <= self.init_scale:
            raise ConfigError(f"precision.min_loss_scale must be positive and at most precision.init_scale="
                              f"{self.init_scale:g}, got {self.min_loss_scale:g}")
        return self

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype or self.dtype]

    @property
    def mixed(self) -> bool:
        """Low-precision parameters with separate fp32 master weights."""
        return self.dtype != "fp32"

    @property
    def below_fp32(self) -> bool:
        """Anything computed or reduced below fp32: low-precision parameters, or fp32 parameters whose
        gradients are reduced in a lower dtype. Either needs fp32 master weights beside the parameters."""
        return self.mixed or self.grad_reduce_dtype != torch.float32
