"""Local SGD: data parallelism that averages parameters every ``every`` steps instead of gradients every step.

Each rank trains its replica on its own data with its own optimizer; after every ``every``-th
optimizer step the replicas' parameters are averaged with one all-reduce (2·(N-1)/N·P bytes per rank),
so communication drops by a factor ``every``. With ``every = 1`` and plain SGD it equals synchronous
data parallelism (averaging the parameters after one SGD step = stepping with the averaged gradient).
Optimizer state is not averaged (each rank keeps its own moments, as in Lin et al. 2020).
Forward and backward communicate nothing. ``ddp.mode = "local-sgd"`` (``tessera.train.dp_modes.local_sgd``)
is this mechanism in the trainer.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera import comm
from tessera.comm import CommGroup
from tessera.comm.flat import copy_from_flat
from tessera.errors import ConfigError


class LocalSGD:
    def __init__(self, model: nn.Module | list[torch.Tensor], group: CommGroup, every: int):
        if every < 1:
            raise ConfigError(f"local SGD must average every at least 1 step, got {every}")
        self.model, self.group, self.every = model, group, every
        self.steps = 0
        self.syncs = 0

    def after_step(self) -> bool:
        """Call after each optimizer step; returns True when this step averaged the parameters."""
        self.steps += 1
        if self.steps % self.every:
            return False
        params = list(self.model.parameters()) if isinstance(self.model, nn.Module) else list(self.model)
        flat_P = torch.cat([p.detach().reshape(-1) for p in params])
        comm.all_reduce(flat_P, self.group, op="avg")
        copy_from_flat(params, flat_P)
        self.syncs += 1
        return True
