"""Configuration of sharded data parallelism (the ``[zero]`` section); the stage itself is
``parallel.zero_stage``."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.errors import ConfigError

WRAP_POLICIES = ("block", "size", "manual")


class _CountType(type):
    def __instancecheck__(cls, value) -> bool:  # a TOML integer or boolean is a valid value as it is
        return isinstance(value, int)


class UnitCount(int, metaclass=_CountType):
    """A count of ZeRO-3 units that also reads ``true`` / ``false`` as 1 / 0 (``zero.prefetch`` was a
    switch before it was a bound), from TOML and from the command line alike."""

    def __new__(cls, value=0):
        text = str(value).strip().lower()
        return super().__new__(cls, {"true": 1, "false": 0}.get(text, value))


UnitCount.__name__ = "int"  # what a wrong value is reported as expecting: "expects int, got 'x'"

OFFLOAD_MODES = ("none", "host", "disk")


class _ModeType(type):
    def __instancecheck__(cls, value) -> bool:  # a TOML string or boolean is a valid value as it is
        return isinstance(value, (str, bool))


class OffloadMode(str, metaclass=_ModeType):
    """Where ZeRO keeps the fp32 master weights and the optimizer state: "none", "host" or "disk"; reads
    ``true`` / ``false`` as "host" / "none" (``zero.offload`` was a switch before it named a place)."""

    def __new__(cls, value="none"):
        text = str(value).strip().lower()
        return super().__new__(cls, {"true": "host", "false": "none"}.get(text, text))


OffloadMode.__name__ = "str"


@dataclass
class ZeroConfig:
    bucket_mb: float = 25.0  # ZeRO-1/2: gradient bucket size cap (each bucket is one reduce-scatter)
    # fp32 master weights, optimizer state and step: "host" memory (ZeRO-3: param shards too), or "disk": in
    # files under offload_dir, streamed through a few chunk buffers by the (host) step; true/false = host/none
    offload: OffloadMode = OffloadMode("none")
    offload_dir: str = ""  # zero.offload="disk": folder of the state files ("": <run.out_dir>/offload)
    offload_chunk_mb: float = 16.0  # zero.offload="disk": MB of each state tensor streamed per chunk
    reshard_after_forward: bool = True  # ZeRO-3: free a unit's gathered parameters after its forward
    prefetch: UnitCount = 1  # ZeRO-3: units gathered ahead of the one computing (0 = none; true/false = 1/0)
    wrap_policy: str = "block"  # ZeRO-3 units: "block" (each transformer block), "size" (min_params) or "manual" (wrap())
    min_params: int = 100_000  # ZeRO-3 "size" policy: a module with at least this many parameters is a unit
    allgather_bucket_mb: float = 0.0  # ZeRO-1/2: parameter all-gather bucket size cap after the step (0: bucket_mb)
    prefetch_params: int = 0  # ZeRO-3: prefetch units ahead until this many parameters are in flight (0: zero.prefetch units)
    max_live_params: int = 0  # ZeRO-3: gathered parameters held at once, at most (0: no limit)
    wrap_paths: list[str] = field(default_factory=list)  # ZeRO-3 "manual" policy from the config: module paths ("layers.0", "layers.*")
    wrap_classes: list[str] = field(default_factory=list)  # ZeRO-3 "manual" policy from the config: module class names

    def __post_init__(self):
        self.offload = OffloadMode(self.offload)  # ZeroConfig(offload=True) as "host"

    def validate(self) -> ZeroConfig:
        if self.bucket_mb <= 0:
            raise ConfigError(f"zero.bucket_mb must be positive, got {self.bucket_mb}")
        if self.wrap_policy not in WRAP_POLICIES:
            raise ConfigError(f"zero.wrap_policy must be one of {', '.join(WRAP_POLICIES)}, got '{self.wrap_policy}'")
        self.prefetch = int(self.prefetch)  # true/false from TOML arrive as bools
        if self.prefetch < 0:
            raise ConfigError(f"zero.prefetch must be 0 (no prefetch) or more units, got {self.prefetch}")
        if self.min_params < 1:
            raise ConfigError(f"zero.min_params must be at least 1, got {self.min_params}")
        self.offload = OffloadMode(self.offload)
        if self.offload not in OFFLOAD_MODES:
            raise ConfigError(f"zero.offload must be one of {', '.join(OFFLOAD_MODES)} (or true / false), "
                              f"got '{self.offload}'")
        if self.offload_chunk_mb <= 0:
            raise ConfigError(f"zero.offload_chunk_mb must be positive, got {self.offload_chunk_mb}")
        for key in ("allgather_bucket_mb", "prefetch_params", "max_live_params"):
            if getattr(self, key) < 0:
                raise ConfigError(f"zero.{key} must be 0 (see docs/CONFIG.md) or positive, got {getattr(self, key)}")
        for key in ("wrap_paths", "wrap_classes"):  # matched against the model by tessera.train.wrap_check.check_wrap_config
            if not all(name.strip() for name in getattr(self, key)):
                raise ConfigError(f"zero.{key} holds an empty name: {getattr(self, key)!r}")
        return self
