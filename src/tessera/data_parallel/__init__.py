"""Data parallelism: replicas on every data-parallel rank, gradients reduced in buckets (the one
mechanism, ``reducer.GradReducer``, that ZeRO-1/2 and the pipeline use too)."""

from tessera.data_parallel.buckets import Bucket, build_buckets
from tessera.data_parallel.config import DDPConfig
from tessera.data_parallel.ddp import DistributedDataParallel
from tessera.data_parallel.reducer import AllReduce, GradReducer, Reduction

__all__ = ["AllReduce", "Bucket", "DDPConfig", "DistributedDataParallel", "GradReducer", "Reduction",
           "build_buckets"]
