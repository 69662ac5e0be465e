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

Without a flush (``pipeline.flush = false``) a step's action list also runs the next step's first
forwards (micro-batch numbers m.. of the call); :meth:`carry` renumbers those in-flight micro-batches when
the next call begins, so their backward still finds the leaves (the version) their forward used. The rule
is then the papers' over the whole stream of micro-batches: PipeDream's micro-batch g at stage s of S uses
version max(0, g - (S-1-s)), the weights updated with micro-batches up to g - (S-s) (vertical sync: every
stage max(0, g - (S-1))); 2BW's batch t uses version t-1 on every stage, its lookahead forwards included.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from tessera.pipeline.schedules import Schedule



def shift_microbatches(d: dict, m: int) -> dict:
    """``{(stage, mb): v}`` with every micro-batch index moved down by ``m`` (a call without a flush hands
    its micro-batches m.. to the next call as 0..)."""
    return {(s, mb - m): v for (s, mb), v in d.items()}

class WeightVersions:
    def __init__(self, stages: dict[int, nn.Module], schedule: Schedule, rank: int, vertical_sync: bool = False):
        self.stages, self.schedule, self.rank = stages, schedule, rank
        self.vertical_sync = vertical_sync
        self.calls = 0  # step() calls started
        self.updates = 0  # optimizer updates of this rank so far (the live weights' version)
        self.snapshots: dict[int, dict[int, dict[str, torch.Tensor]]] = {s: {} for s in stages}
        self.leaves: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.used: dict[tuple[int, int], int] = {}  # (stage, mb) in flight -> the version its F used
        self.plan: dict[tuple[int, int], int] = {}  # (stage, mb) -> version, for this call's F's still to run
        self.steps_done = [0] * schedule.pp  # STEP actions each pp rank runs up to the end of this call
        self.stage0: dict[int, int] = {}  # vertical sync: mb -> the version stage 0's forward used
        self.first_mb = 0  # global number of this call's micro-batch 0 (call * m)
        self.log: list[dict] = []  # (stage, mb, global mb g, version, weight checksum) per F and B: for tests

    # ---- which version a micro-batch uses --------------------------------------------------------------

    def _plan(self, schedule: Schedule) -> dict[tuple[int, int], int]:
        """(stage, mb) -> version of every forward this rank runs in this call. PipeDream: the number of
        STEP actions the forward's rank ran before it (all earlier calls included); 2BW: t-1 for batch t."""
        m, call = schedule.n_microbatches, self.calls - 1
        mine = [a for a in schedule.actions[self.rank] if a.kind == "F"]
        if schedule.name == "2bw":  # micro-batches m.. are the next batch's (no flush)
            return {(a.stage, a.mb): max(call - 1, 0) if a.mb < m else call for a in mine}
        counts = []
        for q, acts in enumerate(schedule.actions):
            n, seen = self.steps_done[q], {}
            for a in acts:
                if a.kind == "F":
                    seen[(a.stage, a.mb)] = n
                n += a.kind == "STEP"
            counts.append(seen)
            self.steps_done[q] = n
        if not self.vertical_sync:
            return counts[self.rank]
        self.stage0.update({mb: v for (s, mb), v in counts[schedule.rank_of(0)].items() if s == 0})
        return {(a.stage, a.mb): self.stage0[a.mb] for a in mine}

    def version(self, stage: int, mb: int) -> int:
        """The version F(stage, mb) and B(stage, mb) of the current call use."""
        return self.used[(stage, mb)] if (stage, mb) in self.used else self.plan[(stage, mb)]

    # ---- executor hooks --------------------------------------------------------------------------------

    def begin_step(self, schedule: Schedule) -> None:
        """A new call running ``schedule``: 2BW's live weights become version ``calls`` (updated once per
        batch)."""
        if schedule.name == "2bw":
            self.updates = self.calls
        self.first_mb = self.calls * schedule.n_microbatches
        self.calls += 1
        self.plan = self._plan(schedule)
        self._stash_live()

    def carry(self, m: int) -> None:
        """End of a call without a flush: the next call's micro-batches m.. in flight become its 0.."""
        self.leaves, self.used = shift_microbatches(self.leaves, m), shift_microbatches(self.used, m)
        self.stage0 = {mb - m: v for mb, v in self.stage0.items() if mb >= m}

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
        v = self.plan.pop((stage, mb))
        if v == self.updates:
            self._stash_live()  # the live weights, copied: a STEP before this B must not change them
        snap = self.snapshots[stage][v]
        leaves = {n: t.detach().requires_grad_() for n, t in snap.items()}  # this mb's own gradients
        self.leaves[(stage, mb)], self.used[(stage, mb)] = leaves, v
        self.log.append({"kind": "F", "stage": stage, "mb": mb, "g": self.first_mb + mb, "version": v,
                         "sum": _checksum(leaves)})
        return functional_call(self.stages[stage], leaves, (x,))  # frozen weights: the module's own

    def after_backward(self, stage: int, mb: int) -> None:
        leaves, v = self.leaves.pop((stage, mb)), self.used.pop((stage, mb))
        self.log.append({"kind": "B", "stage": stage, "mb": mb, "g": self.first_mb + mb, "version": v,
                         "sum": _checksum(leaves)})
        for n, p in self.stages[stage].named_parameters():
            if n not in leaves:  # frozen: no gradient
                continue
            g = leaves[n].grad
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self._drop_unused(stage)

    def _drop_unused(self, stage: int) -> None:
        """Free versions no in-flight or later micro-batch needs (2BW: this batch's and the next's)."""
        if self.schedule.name == "2bw":
            keep = {self.updates, max(self.calls - 2, 0)}
        else:  # later calls' forwards use at least the live version (vertical sync: stage 0's rank's count,
            # or the version stage 0 gave a next-step micro-batch this rank has not run yet)
            m = self.schedule.n_microbatches
            later = ([self.steps_done[self.schedule.rank_of(0)]] + [v for mb, v in self.stage0.items() if mb >= m]
                     if self.vertical_sync else [self.updates])
            floor = min([v for (s, _), v in self.plan.items() if s == stage] + later)
            keep = {v for v in self.snapshots[stage] if v >= floor}
        keep |= {v for (s, _), v in self.used.items() if s == stage} | {self.updates}
        for v in list(self.snapshots[stage]):
            if v not in keep:
                del self.snapshots[stage][v]


def _checksum(params: dict[str, torch.Tensor]) -> float:
    return float(sum(t.detach().double().sum() for t in params.values()))
