"""ZeRO-1/2 for an expert-parallel model: dense state sharded over ``dp``, expert state over ``edp``.

A dense parameter is replicated on every data-parallel rank, so its optimizer state (and, at stage 2,
its gradient) is cut into dp slices; an expert lives on one rank of each ep group and has copies only on
the ``edp`` ranks, so its state is cut into edp slices (with edp of one rank it is not sharded at all).
This is two :class:`ZeroDataParallel` engines over disjoint parameter subsets — the ZeRO counterpart of
:class:`tessera.moe.ExpertDataParallel` — stepped by ONE optimizer over both engines' master shards
(param group g holds the dense and the expert masters of the model's group g, so a learning-rate
scheduler drives both alike).

Forward communication: none (at construction dense buckets are broadcast over dp, expert buckets over
edp). Backward communication: one reduce-scatter (sum) per dense bucket over ``dp`` and per expert bucket
over ``edp``. Step: one fp32 all-reduce per norm axis (ep, edp, tp), a finiteness flag over dp, then one
all-gather per bucket of the updated slices (dense over dp, experts over edp).

Clipping norm: ``dp`` = ``ep`` × ``edp`` (dp index = edp index · ep + ep index), and every rank holds
a different dense slice (sharded over dp) and a different expert slice (different experts over ep,
different slices over edp), so every slice is sharded on {ep, edp} (plus tp where tensor parallelism
split it); summing over ep then edp counts each element once (``tessera.grad_norm``).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch import nn

from tessera.comm.group import CommGroup
from tessera.grad_norm import GradPiece, clip_grad_norm
from tessera.moe.expert_parallel import expert_parameters
from tessera.zero.stage12 import ZeroDataParallel


class ExpertZeroDataParallel(nn.Module):
    """ZeRO-``stage`` (1 or 2) around an expert-parallel ``module``; exposes the sharded-engine interface
    (``optimizer``, ``clip_grad_norm``, ``step``, ``zero_grad``, ``gather_params``, ``memory_tensors``,
    ``no_sync``, ``update.shards``). ``parts`` = (dense engine, expert engine)."""

    def __init__(self, module: nn.Module, param_groups: list[dict], make_optimizer, dp: CommGroup,
                 edp: CommGroup, ep: CommGroup, stage: int, bucket_mb: float = 25.0,
                 offload_device: torch.device | None = None, norm_axes: dict[str, CommGroup] | None = None,
                 param_axes=None):
        super().__init__()
        self.module, self.stage = module, stage
        experts = {id(p) for p in expert_parameters(module)}
        single = CommGroup.single("dp_replicate", dp.ledger, dp.device)

        def subset(keep):
            return [{**g, "params": [p for p in g["params"] if keep(id(p) in experts)]} for g in param_groups]

        common = dict(bucket_mb=bucket_mb, offload_device=offload_device, param_axes=param_axes)
        # each engine's norm axes beyond its shard group, which its finiteness flag also crosses so that it
        # reaches every rank of the job: the dense slices are sharded over dp (which holds ep), the expert
        # slices over edp and, being different experts, ep; both over every further axis (tp)
        others = {k: v for k, v in (norm_axes or {}).items() if k != "ep"}
        # a plain tuple, so the wrapped module is not registered three times
        self.parts = (ZeroDataParallel(module, subset(lambda e: not e), make_optimizer, dp, single, stage,
                                       norm_axes=others, **common),
                      ZeroDataParallel(module, subset(lambda e: e), make_optimizer, edp, single, stage,
                                       norm_axes={"ep": ep, **others}, **common))
        # ONE optimizer: group g = the dense and expert masters of the model's group g
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [s.master for e in self.parts for s in e.update.shards if s.param_group == i]}
                  for i, g in enumerate(param_groups)]
        self.optimizer = make_optimizer([g for g in groups if g["params"]])
        for e in self.parts:
            e.optimizer = e.update.optimizer = self.optimizer
        self.update = SimpleNamespace(shards=[s for e in self.parts for s in e.update.shards])
        self.norm_axes = {"ep": ep, "edp": edp, **others}
        self.device = self.parts[0].update.device

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        with self.parts[0].no_sync(), self.parts[1].no_sync():
            yield

    def reduce_gradients(self) -> None:
        for e in self.parts:
            e.reduce_gradients()

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, inv_scale: float = 1.0) -> tuple[float, bool]:
        """Unscale, check finiteness on every rank, clip both engines' slices by the job-wide norm."""
        finite = all([e.update.prepare_grads(inv_scale) for e in self.parts])  # both run: collectives
        if not finite:
            return float("inf"), False
        # each engine's pieces are sharded on its shard group ("dp_shard"): dp = ep × edp, edp (+ ep)
        pieces = [GradPiece(p.grad, (p.sharded - {"dp_shard"}) | {"ep", "edp"})
                  for e in self.parts for p in e.update.norm_pieces()]
        norm = clip_grad_norm(pieces, self.norm_axes, max_norm, device=self.device,
                              scale=[s.master.grad for s in self.update.shards])
        return norm, True

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step over every master slice, then both engines all-gather their buckets."""
        self.optimizer.step()
        for e in self.parts:
            e.update.refresh_params()
            e.gather_params()

    def gather_params(self) -> None:
        for e in self.parts:
            e.gather_params()

    def zero_grad(self) -> None:
        for e in self.parts:
            e.zero_grad()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Both engines' tensors; the shared optimizer's state is listed by each, so keep each once."""
        out: dict[str, list[torch.Tensor]] = {}
        for e in self.parts:
            for key, tensors in e.memory_tensors().items():
                seen = {id(t) for t in out.setdefault(key, [])}
                out[key] += [t for t in tensors if id(t) not in seen]
        return out


def expert_zero(model: nn.Module, topology, param_groups, make_optimizer, stage: int, zero,
                norm_axes=None, param_axes=None) -> ExpertZeroDataParallel:
    """The ZeRO path of ``parallelize`` for ep > 1 (experts already sharded over ep): ``param_groups``
    may be a callable ``model -> groups`` (called now, after the experts were replaced)."""
    if callable(param_groups):
        param_groups = param_groups(model)
    return ExpertZeroDataParallel(model, param_groups, make_optimizer, topology.group("dp"), topology.group("edp"),
                                  topology.group("ep"), stage, bucket_mb=zero.bucket_mb,
                                  offload_device=torch.device("cpu") if zero.offload else None,
                                  norm_axes=norm_axes, param_axes=param_axes)
