"""Weight versions for the asynchronous schedules: PipeDream weight stashing and PipeDream-2BW.

A stage's forward for micro-batch ``mb`` runs on a *version* of its weights through
``torch.func.functional_call`` with fresh leaf tensors that share the stashed version's storage, so the
autograd graph itself holds the weights the forward used and the backward necessarily uses the same ones,
however many optimizer steps happened in between. After the backward the leaves' gradients move into the
live parameters' ``.grad`` for the optimizer.

Version numbers count this rank's optimizer updates:
- ``pipedream``: the rank steps after every backward; mb's version at stage s is the number of STEP
  actions this rank ran before F(s, mb) (plus all earlier calls). With ``vertical_sync`` every stage uses
  the version stage 0 used for that micro-batch (Narayanan et al. 2019, §3.3).
- ``2bw``: one update per batch (the trainer's optimizer step after ``step()``); batch t runs on version
  t-1 (the copy kept from before the last update), so two versions live at any time (Narayanan et al. 2021).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from tessera.pipeline.schedules import Schedule


class WeightVersions:
    def __init__(self, stages: dict[int, nn.Module], schedule: Schedule, rank: int, vertical_sync: bool = False):
        self.stages, self.schedule, self.rank = stages, schedule, rank
        self.vertical_sync = vertical_sync
        self.calls = 0  # step() calls started
        self.updates = 0  # optimizer updates of this rank so far (the live weights' version)
        self.snapshots: dict[int, dict[int, dict[str, torch.Tensor]]] = {s: {} for s in stages}
        self.leaves: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.log: list[dict] = []  # (stage, mb, version, weight checksum) per F and B: for tests

    # ---- which version a micro-batch uses --------------------------------------------------------------

    def _steps_before(self, rank: int, stage: int, mb: int) -> int:
        n = 0
        for a in self.schedule.actions[rank]:
            if a.kind == "F" and a.stage == stage and a.mb == mb:
                return n
            n += a.kind == "STEP"
        raise KeyError((stage, mb))

    def version(self, stage: int, mb: int, call: int | None = None) -> int:
        """The version F(stage, mb) and B(stage, mb) of step call ``call`` (default: the current) use."""
        call = self.calls - 1 if call is None else call
        if self.schedule.name == "2bw":
            return max(call - 1, 0)
        per_call = sum(a.kind == "STEP" for a in self.schedule.actions[self.rank])
        if self.vertical_sync:
            return call * per_call + self._steps_before(self.schedule.rank_of(0), 0, mb)
        return call * per_call + self._steps_before(self.rank, stage, mb)

    # ---- executor hooks --------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new batch: 2BW's live weights become version ``calls`` (updated once per batch)."""
        if self.schedule.name == "2bw":
            self.updates = self.calls
        self.calls += 1
        self._stash_live()

    def before_update(self) -> None:
        """STEP is about to change the live weights: keep this version if a later forward needs it."""
        self._stash_live()
        self.updates += 1

    def _stash_live(self) -> None:
        for s, module in self.stages.items():
            if self.updates not in self.snapshots[s]:
                # trainable weights only: frozen ones (LoRA's base) never change, so every version shares them
                self.snapshots[s][self.updates] = {n: p.detach().clone() for n, p in module.named_parameters()
                                                   if p.requires_grad}

    def forward(self, stage: int, mb: int, x: torch.Tensor) -> torch.Tensor:
        v = self.version(stage, mb)
        if v == self.updates:
            self._stash_live()  # the live weights, copied: a STEP before this B must not change them
        snap = self.snapshots[stage][v]
        leaves = {n: t.detach().requires_grad_() for n, t in snap.items()}  # this mb's own gradients
        self.leaves[(stage, mb)] = leaves
        self.log.append({"kind": "F", "stage": stage, "mb": mb, "version": v, "sum": _checksum(leaves)})
        return functional_call(self.stages[stage], leaves, (x,))  # frozen weights: the module's own

    def after_backward(self, stage: int, mb: int) -> None:
        leaves = self.leaves.pop((stage, mb))
        self.log.append({"kind": "B", "stage": stage, "mb": mb, "version": self.version(stage, mb),
                         "sum": _checksum(leaves)})
        for n, p in self.stages[stage].named_parameters():
            if n not in leaves:  # frozen: no gradient
                continue
            g = leaves[n].grad
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self._drop_unused(stage)

    def _drop_unused(self, stage: int) -> None:
        """Free versions no in-flight or later micro-batch of this call (nor the next 2BW batch) needs."""
        keep = {self.updates}
        if self.schedule.name == "2bw":
            keep.add(max(self.calls - 2, 0))  # this batch runs on the version before the last update
        else:
            keep |= {self.version(stage, mb) for mb in range(self.schedule.n_microbatches)}
            keep |= {self.version(stage, mb, self.calls) for mb in range(self.schedule.n_microbatches)}
        for v in list(self.snapshots[stage]):
            if v not in keep and all(k[0] != stage or self.version(*k) != v for k in self.leaves):
                del self.snapshots[stage][v]


def _checksum(params: dict[str, torch.Tensor]) -> float:
    return float(sum(t.detach().double().sum() for t in params.values()))
