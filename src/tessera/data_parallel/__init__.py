"""Data parallelism: replicas on every data-parallel rank, gradients reduced in buckets."""

from tessera.data_parallel.config import DDPConfig
from tessera.data_parallel.ddp import DistributedDataParallel

__all__ = ["DDPConfig", "DistributedDataParallel"]
