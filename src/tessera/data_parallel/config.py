"""Configuration of data parallelism (the ``[ddp]`` section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.errors import ConfigError

# ``mode`` / ``consistency`` names (what each mode does and how it is built: tessera.train.dp_modes)
MODE_NAMES = ("allreduce", "local-sgd", "ps-rank0", "ps-sharded", "dataparallel", "central-storage")
CONSISTENCIES = ("sync", "ssp", "async")


@dataclass
class DDPConfig:
    """Every data-parallel reduction without ZeRO takes these: DDP, expert data parallelism (dense over
    dp, experts over edp) and the pipeline's reduction of each stage over dp."""

    bucket_mb: float = 25.0  # gradient bucket size cap; smaller buckets start communicating sooner
    find_unused_parameters: bool = False  # one extra small all-reduce so globally unused params keep grad=None
    # how data-parallel replicas combine: "allreduce" (DDP), "local-sgd" (average parameters every average_every
    # steps), "ps-rank0" / "ps-sharded" (a parameter server on rank 0 / spread over all ranks), "dataparallel" /
    # "central-storage" (one process driving several devices; variables on the first device / on the host)
    mode: str = "allreduce"
    consistency: str = "sync"  # ps-rank0 / ps-sharded: "sync" (BSP), "ssp" (bounded staleness) or "async"
    staleness: int = 2  # consistency "ssp": the most steps a worker may run ahead of the slowest one
    average_every: int = 4  # mode "local-sgd": optimizer steps between parameter averages
    devices: list[str] = field(default_factory=list)  # "dataparallel" / "central-storage": the devices ([]: see docs)

    def validate(self) -> DDPConfig:
        if self.bucket_mb <= 0:
            raise ConfigError(f"ddp.bucket_mb must be positive, got {self.bucket_mb}")
        if self.mode not in MODE_NAMES:
            raise ConfigError(f"ddp.mode must be one of {', '.join(MODE_NAMES)}, got {self.mode!r}")
        if self.consistency not in CONSISTENCIES:
            raise ConfigError(f"ddp.consistency must be one of {', '.join(CONSISTENCIES)}, got {self.consistency!r}")
        if self.average_every < 1:
            raise ConfigError(f"ddp.average_every must be at least 1, got {self.average_every}")
        return self
