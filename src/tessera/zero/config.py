"""Configuration of sharded data parallelism (the ``[zero]`` section); the stage itself is
``parallel.zero_stage``."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError

WRAP_POLICIES = ("block", "size", "manual")


@dataclass
class ZeroConfig:
    bucket_mb: float = 25.0  # ZeRO-1/2: gradient bucket size cap (each bucket is one reduce-scatter)
    offload: bool = False  # fp32 master weights, optimizer state and step on the host (ZeRO-3: param shards too)
    reshard_after_forward: bool = True  # ZeRO-3: free a unit's gathered parameters after its forward
    prefetch: bool = True  # ZeRO-3: start the next unit's all-gather while this unit computes
    wrap_policy: str = "block"  # ZeRO-3 units: "block" (each transformer block), "size" (min_params) or "manual" (wrap())
    min_params: int = 100_000  # ZeRO-3 "size" policy: a module with at least this many parameters is a unit

    def validate(self) -> ZeroConfig:
        if self.bucket_mb <= 0:
            raise ConfigError(f"zero.bucket_mb must be positive, got {self.bucket_mb}")
        if self.wrap_policy not in WRAP_POLICIES:
            raise ConfigError(f"zero.wrap_policy must be one of {', '.join(WRAP_POLICIES)}, got '{self.wrap_policy}'")
        if self.min_params < 1:
            raise ConfigError(f"zero.min_params must be at least 1, got {self.min_params}")
        return self
