"""Configuration of activation checkpointing (the ``[checkpointing]`` section)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError

MODES = ("none", "full", "selective")


@dataclass
class RecomputeConfig:
    mode: str = "none"  # "none"; "full": recompute whole blocks; "selective": keep matmul outputs only
    every: int = 1  # checkpoint every k-th transformer block (1 = all of them)

    def validate(self) -> RecomputeConfig:
        if self.mode not in MODES:
            raise ConfigError(f"checkpointing.mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        if self.every < 1:
            raise ConfigError(f"checkpointing.every must be at least 1, got {self.every}")
        return self
