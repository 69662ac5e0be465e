"""Configuration of data parallelism (the ``[ddp]`` section)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError


@dataclass
class DDPConfig:
    """Every data-parallel reduction without ZeRO takes these: DDP, expert data parallelism (dense over
    dp, experts over edp) and the pipeline's reduction of each stage over dp."""

    bucket_mb: float = 25.0  # gradient bucket size cap; smaller buckets start communicating sooner
    find_unused_parameters: bool = False  # one extra small all-reduce so globally unused params keep grad=None

    def validate(self) -> DDPConfig:
        if self.bucket_mb <= 0:
            raise ConfigError(f"ddp.bucket_mb must be positive, got {self.bucket_mb}")
        return self
