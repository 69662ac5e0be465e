"""Data parallelism for an expert-parallel model: dense gradients over ``dp``, expert gradients over ``edp``.

A dense parameter is replicated on every data-parallel rank, so its gradient is summed over ``dp``.
An expert lives on one rank of each ep group; its copies are the ``edp`` ranks (same ep index in the
other ep groups), and after backward it already holds the gradient of every token its ep group sent
it, so it is summed over ``edp`` only. Both sums follow the house loss convention (each micro-batch's
summed loss divided by the GLOBAL token count), which makes the result equal one process.

Both are tessera's DistributedDataParallel over a subset of the parameters (the one data-parallel
reducer, ``tessera.data_parallel.reducer``), so the gradients travel in buckets launched from gradient
hooks during backward, as for a dense model, with the same ``[ddp]`` settings. Forward communication:
none (at construction dense state is broadcast from dp rank 0 and expert state from edp rank 0).
Backward communication: bucketed all-reduces (sum) of the dense gradients on ``dp`` and of the expert
gradients on ``edp``: 2(dp−1)/dp · dense bytes + 2(edp−1)/edp · local expert bytes per rank. Inside
``no_sync()`` gradients only accumulate. A parameter without a gradient contributes zeros (with
``find_unused_parameters``: keeps ``grad = None`` when no rank of its group has one). ``manual``: the
hooks stay silent (as inside ``no_sync`` for the wrapper's whole life) and :meth:`reduce_gradients`
reduces what a pipeline schedule's many backwards accumulated, once per step, with the same buckets.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.data_parallel import DistributedDataParallel
from tessera.moe.expert_parallel import apply_expert_parallel, expert_parameters


class ExpertDataParallel(nn.Module):
    """Wraps an expert-parallel ``module``; ``dp`` and ``edp`` are CommGroups from the Topology."""

    def __init__(self, module: nn.Module, dp: CommGroup, edp: CommGroup, bucket_mb: float = 25.0,
                 find_unused_parameters: bool = False, manual: bool = False):
        super().__init__()
        self.module, self.dp, self.edp = module, dp, edp
        experts = {id(p) for p in expert_parameters(module)}
        params = [p for p in module.parameters() if p.requires_grad]
        dense = [p for p in params if id(p) not in experts]
        self.dense_parameters = dense
        # a plain list, so the wrapped module is not registered three times
        # buffers and frozen parameters are made equal below, each over its own group
        common = dict(bucket_mb=bucket_mb, find_unused_parameters=find_unused_parameters, reduce_op="sum",
                      broadcast_buffers=False)
        self._replicas = [
            DistributedDataParallel(module, dp, parameters=dense, **common),
            DistributedDataParallel(module, edp, parameters=[p for p in params if id(p) in experts], **common),
        ]
        _broadcast_untrained(module, dp, edp, experts)
        self._silenced = contextlib.ExitStack()  # manual mode: no_sync held open until the wrapper goes
        if manual:
            self._silenced.enter_context(self.no_sync())

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        return [buf for ddp in self._replicas for buf in ddp.grad_buffers]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        with self._replicas[0].no_sync(), self._replicas[1].no_sync():
            yield

    def reduce_gradients(self) -> None:
        """Reduce the gradients accumulated since the last reduction: dense over dp, then experts over edp
        (the same buckets and collectives as a synchronised backward; for manual mode)."""
        for ddp in self._replicas:
            ddp.reducer.reduce_gradients()


@torch.no_grad()
def _broadcast_untrained(module: nn.Module, dp: CommGroup, edp: CommGroup, experts: set[int]) -> None:
    """What no gradient reduction covers starts from one rank's values: buffers and frozen dense parameters
    (a LoRA job's base weights) from dp rank 0, frozen expert parameters from edp rank 0 (over dp they
    are other experts, which a dp-wide broadcast would overwrite). One message each (they start equal by
    construction when built from initial-value origins; this is for models built otherwise)."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    for t in [p for p in frozen if id(p) not in experts] + list(module.buffers()):
        comm.broadcast(t.data, dp, src=0)
    for p in [p for p in frozen if id(p) in experts]:
        comm.broadcast(p.data, edp, src=0)


def expert_parallelize(model: nn.Module, topology, ddp=None, manual: bool = False) -> ExpertDataParallel:
    """The expert-parallel step of ``parallelize``: shard the experts of ``model`` over the topology's
    ``ep`` group, then reduce dense gradients over ``dp`` and expert gradients over ``edp`` (× cp under context
    parallelism: ``dp_cp``, ``edp_cp``) (``ddp``: the
    DDPConfig whose bucket size and find_unused_parameters both reductions take; ``manual``: only in
    ``reduce_gradients()``)."""
    apply_expert_parallel(model, topology.group("ep"))
    kwargs = {} if ddp is None else dict(bucket_mb=ddp.bucket_mb, find_unused_parameters=ddp.find_unused_parameters)
    cp = topology.size("cp") > 1  # the cp ranks hold the same parameters and see other tokens
    return ExpertDataParallel(model, topology.group("dp_cp" if cp else "dp"), topology.group("edp_cp" if cp else "edp"),
                              manual=manual, **kwargs)
