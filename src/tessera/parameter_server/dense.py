"""Dense-model gradient exchange, three ways the seeds compare (each equals one-process training).

N data-parallel ranks each back-propagate their slice of the global batch (loss already divided by
the global batch, so the gradients sum to the global mean); ``step()`` then exchanges and updates:

- ``"ps_rank0"``: a parameter server on rank 0 (also TensorFlow's CentralStorage across workers).
  Gather every rank's flat gradient [P] to rank 0, which sums them and runs the optimizer on the only
  copy of the optimizer state; scatter the new parameters [P] back. Rank 0's link carries
  (N-1)·P in and (N-1)·P out: it is the bottleneck.
- ``"ps_sharded"``: the server spread over all ranks. Rank r owns flat slice r (P/N, padded):
  reduce-scatter the gradients, update the owned slice, all-gather the parameters; every rank's link
  carries 2·(N-1)/N·P, as a ring all-reduce does, and the optimizer state is split N ways.
- ``"allreduce"``: ring all-reduce of the gradients; every rank runs the optimizer on a full replica.

Forward/backward communicate nothing; ``step()`` issues the collectives above through tessera.comm, so
the CommLedger records them (axis of the group passed in).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from tessera import comm
from tessera.comm import CommGroup
from tessera.comm.flat import copy_from_flat, unflatten_views
from tessera.errors import ConfigError

DENSE_STRATEGIES = ("ps_rank0", "ps_sharded", "allreduce")


class DenseParameterSync:
    def __init__(self, model: nn.Module, group: CommGroup, strategy: str,
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        if strategy not in DENSE_STRATEGIES:
            raise ConfigError(f"dense strategy must be one of {', '.join(DENSE_STRATEGIES)}, got '{strategy}'")
        self.group, self.strategy = group, strategy
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.shard = math.ceil(self.numel / group.size)  # P/N rounded up (ps_sharded pads to N·shard)
        flat_P = self._flat([p.detach() for p in self.params], self.numel)
        self.master = None  # the optimizer's parameters: full replica, the server's copy, or a slice
        if strategy == "allreduce":
            self.opt = make_optimizer(self.params)
        elif strategy == "ps_rank0":
            if group.rank == 0:
                self.master = flat_P.clone().requires_grad_()
                self.opt = make_optimizer([self.master])
        else:
            padded = self._flat([flat_P], self.shard * group.size)
            self.master = padded[group.rank * self.shard:(group.rank + 1) * self.shard].clone().requires_grad_()
            self.opt = make_optimizer([self.master])

    @staticmethod
    def _flat(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
        out = torch.zeros(length, dtype=tensors[0].dtype, device=tensors[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=out[: sum(t.numel() for t in tensors)])
        return out

    def _grads(self, length: int) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return self._flat(grads, length)

    def step(self) -> None:
        if self.strategy == "allreduce":
            flat_P = self._grads(self.numel)
            comm.all_reduce(flat_P, self.group)
            self._write_grads(flat_P)
            self.opt.step()
        elif self.strategy == "ps_rank0":
            gathered = comm.gather(self._grads(self.numel), self.group, dst=0)
            new_P = torch.empty(self.numel, device=self.group.device)
            pieces = None
            if self.group.rank == 0:
                self.master.grad = torch.stack(gathered).sum(0)
                self.opt.step()
                pieces = [self.master.detach().clone() for _ in range(self.group.size)]
            comm.scatter(new_P, pieces, self.group, src=0)
            copy_from_flat(self.params, new_P)
        else:
            grad_shard = torch.empty(self.shard, device=self.group.device)
            comm.reduce_scatter(grad_shard, self._grads(self.shard * self.group.size), self.group)
            self.master.grad = grad_shard
            self.opt.step()
            full = torch.empty(self.shard * self.group.size, device=self.group.device)
            comm.all_gather(full, self.master.detach(), self.group)
            copy_from_flat(self.params, full)
        for p in self.params:
            p.grad = None

    def _write_grads(self, flat: torch.Tensor) -> None:
        for p, g in zip(self.params, unflatten_views(flat, self.params)):
            p.grad = g.clone()
