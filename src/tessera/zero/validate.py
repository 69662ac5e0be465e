"""Combinations of ZeRO, mixed precision and activation checkpointing that cannot work, rejected with
one sentence before any rank starts."""

from __future__ import annotations

from tessera.errors import ConfigError
from tessera.zero.config import OffloadMode


def validate_memory_savers(cfg) -> None:
    """``cfg`` is a JobConfig (sections ``parallel``, ``zero``, ``precision``). A ``[ddp]`` key under ZeRO is
    refused by the one rule for settings without effect (``tessera.train.settings``)."""
    stage = cfg.parallel.zero_stage
    if OffloadMode(cfg.zero.offload) != "none" and stage == 0:
        raise ConfigError("zero.offload moves the sharded optimizer to the host, so it needs "
                          "parallel.zero_stage of 1, 2 or 3")
    if cfg.precision.dtype == "fp32" and cfg.precision.loss_scale == "dynamic":
        raise ConfigError("precision.loss_scale=dynamic protects fp16 gradients from underflow and has no "
                          "use with precision.dtype=fp32; set precision.loss_scale=none")
