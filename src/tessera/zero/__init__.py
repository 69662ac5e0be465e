"""ZeRO-1/2/3 and FSDP: optimizer state, gradients and parameters sharded over ``dp_shard``
(replicated over ``dp_replicate`` for hybrid sharding), with CPU offload of the update."""

from tessera.zero.config import ZeroConfig
from tessera.zero.stage12 import ZeroDataParallel
from tessera.zero.stage3 import FullyShardedDataParallel
from tessera.zero.wrap import class_policy, enable_wrap, manual_policy, size_policy, wrap

__all__ = ["FullyShardedDataParallel", "ZeroConfig", "ZeroDataParallel", "class_policy", "enable_wrap",
           "manual_policy", "size_policy", "wrap"]
