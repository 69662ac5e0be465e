"""ZeRO (stages 0-3) for an expert-parallel model: dense state over the data-parallel ranks, expert
state over ``edp``.

A dense parameter is replicated on every data-parallel rank, so its state is sharded like a dense
model's (``tessera.zero.build.dense_groups``): over ``dp``, or over ``dp_shard`` and replicated over
``dp_replicate`` with hybrid sharding. An expert lives on one rank of each ep group and has copies only on
the ``edp`` ranks, so its state is cut into edp slices (with edp of one rank it is not sharded at all).
Under hybrid sharding the experts stay sharded over the whole ``edp`` group: edp (= dp/ep) is already
the small group, and the topology has no expert counterpart of dp_shard × dp_replicate to split it by
(dense state is sharded over ``dp_shard`` and replicated over ``dp_replicate``). Stage 0 (fp32 master
weights without sharding, for mixed precision) replicates the dense state over dp and the experts over
edp. This is two engines over disjoint parameter subsets (``tessera.zero.build.build_engine``: ZeRO-1/2's
:class:`ZeroDataParallel` or ZeRO-3's :class:`FullyShardedDataParallel`, whose units then gather dense
flats over dp and expert flats over edp) — the ZeRO counterpart of :class:`tessera.moe.ExpertDataParallel`
— stepped by ONE optimizer over both engines' master shards (param group g holds the dense and the expert
masters of the model's group g, so a learning-rate scheduler drives both alike).

Built from the meta device (ZeRO-3 only; the other stages receive real parameters): the dense engine fills
its flat slices from the origins of the dense parameters (frozen ones included, in flats of their own)
and leaves the experts, still on the meta device, to the expert engine, which fills its slices from
theirs (``tessera.zero.stage3``); no rank ever allocates a whole parameter it does not own.

Communication per step, as each stage has it for a dense model, with the dense collectives on dp (or
dp_shard, then an all-reduce of slices over dp_replicate) and the expert ones on edp: ZeRO-1/2 a
reduce-scatter per bucket in backward and an all-gather per bucket after the step; ZeRO-3 an all-gather per
unit flat before its forward and its backward and a reduce-scatter of it after its backward; stage 0 an
all-reduce per bucket. Then one fp32 all-reduce per norm axis, a finiteness flag over the job. ``manual``:
no reduction from backward, only :meth:`reduce_gradients` (a pipeline's many backwards per step).

Clipping norm: the dense slices and the expert slices follow different layouts (dense: sharded over its
shard group, identical on its replicas; experts: different experts over ep, slices over edp), so each
engine's squares are summed job-wide over its own axes (``tessera.grad_norm``: every element counted
once), and the job's norm is the norm of those two norms.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch import nn

from tessera.comm.group import CommGroup
from tessera.grad_norm import GradPiece, clip_grad_norm, global_grad_norm
from tessera.models.layers import TransformerBlock
from tessera.moe.expert_parallel import expert_parameters
from tessera.precision.config import PrecisionConfig
from tessera.zero.build import build_engine, dense_groups
from tessera.zero.offload import StreamedAdamW, for_disk_masters


class ExpertZeroDataParallel(nn.Module):
    """ZeRO-``stage`` (0-3) around an expert-parallel ``module``; exposes the sharded-engine interface
    (``optimizer``, ``clip_grad_norm``, ``step``, ``zero_grad``, ``gather_params``, ``memory_tensors``,
    ``no_sync``, ``reduce_gradients``, ``update.shards``). ``parts`` = (dense engine, expert engine), built
    by ``make_part(groups, shard, replicate, norm_axes, frozen)`` (``frozen``: its parameters needing no
    gradient); ``dense`` / ``experts`` are their (shard,
    replicate) groups; ``ep`` the expert-parallel group."""

    def __init__(self, module: nn.Module, param_groups: list[dict], make_optimizer, make_part,
                 dense: tuple[CommGroup, CommGroup], experts: tuple[CommGroup, CommGroup], ep: CommGroup,
                 norm_axes: dict[str, CommGroup] | None = None):
        super().__init__()
        self.module = module
        is_expert = {id(p) for p in expert_parameters(module)}

        def subset(keep):
            return [{**g, "params": [p for p in g["params"] if keep(id(p) in is_expert)]} for g in param_groups]

        # each engine's norm axes beyond its shard group, which its finiteness flag also crosses so that it
        # reaches every rank of the job: the dense slices span the data-parallel ranks (which hold ep), the
        # expert slices edp and, being different experts, ep; both every further axis (tp)
        others = {k: v for k, v in (norm_axes or {}).items() if k != "ep"}
        # frozen parameters (LoRA's base weights) go with their kind too: ZeRO-3 shards the experts' over edp
        frozen = [p for p in module.parameters() if not p.requires_grad]
        frozen_dense = [p for p in frozen if id(p) not in is_expert]
        # a plain tuple, so the wrapped module is not registered three times
        self.parts = (make_part(subset(lambda e: not e), *dense, others, frozen_dense),
                      make_part(subset(lambda e: e), *experts, {"ep": ep, **others},
                                [p for p in frozen if id(p) in is_expert]))
        left = [n for n, p in module.named_parameters() if p.is_meta]
        if left:  # a meta parameter in neither engine's param groups: nothing would ever fill it
            raise ValueError(f"expert ZeRO: parameters {left[:3]} are on the meta device and in no param group")
        # ONE optimizer: group g = the dense and expert masters of the model's group g
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [s.master for e in self.parts for s in e.update.shards if s.param_group == i]}
                  for i, g in enumerate(param_groups)]
        # masters in offload files (zero.offload = "disk"): the optimizer that streams them
        self.optimizer = for_disk_masters(make_optimizer([g for g in groups if g["params"]]))
        if isinstance(self.optimizer, StreamedAdamW):
            self.optimizer.ensure_state()  # the moments' files at start (a full disk fails here, not in a step)
        for e in self.parts:
            e.optimizer = e.update.optimizer = self.optimizer
        self.update = SimpleNamespace(shards=[s for e in self.parts for s in e.update.shards])
        self.device = self.parts[0].update.device

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """ZeRO-1 (and stage 0) accumulate locally; ZeRO-2/3 reduce every backward (nothing to put off)."""
        with contextlib.ExitStack() as stack:
            for e in self.parts:
                if hasattr(e, "no_sync"):
                    stack.enter_context(e.no_sync())
            yield

    def reduce_gradients(self) -> None:
        """Manual mode: reduce what the step's backwards accumulated (dense engine first, then experts)."""
        for e in self.parts:
            e.reduce_gradients()

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, inv_scale: float = 1.0) -> tuple[float, bool]:
        """Unscale, check finiteness on every rank, clip both engines' slices by the job-wide norm."""
        finite = all([e.update.prepare_grads(inv_scale) for e in self.parts])  # both run: collectives
        if not finite:
            return float("inf"), False
        # each part's job-wide norm over its own layout: its shard group ("dp_shard": dp, dp_shard or edp;
        # its replicas hold identical slices) and tp; expert slices also differ along ep
        norms = [global_grad_norm([GradPiece(p.grad, p.sharded | extra) for p in e.update.norm_pieces()],
                                  e.update.norm_axes, self.device)
                 for e, extra in zip(self.parts, (frozenset(), frozenset({"ep"})))]
        # ‖(‖dense‖, ‖experts‖)‖ is the job's norm; clip_grad_norm scales every master gradient by it
        norm = clip_grad_norm([GradPiece(torch.stack(norms))], {}, max_norm, device=self.device,
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

    @property
    def flats(self) -> list:
        """ZeRO-3: both parts' flat parameters (dense, then experts); [] at stages 0–2."""
        return [f for e in self.parts for f in getattr(e, "flats", ())]

    def flat_shards(self) -> list:
        """Both engines' flat master slices (dense, then experts), as ``ZeroDataParallel.flat_shards``."""
        return [x for e in self.parts for x in e.flat_shards()]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Both engines' tensors; the shared optimizer's state is listed by each, so keep each once."""
        out: dict[str, list[torch.Tensor]] = {}
        for e in self.parts:
            for key, tensors in e.memory_tensors().items():
                seen = {id(t) for t in out.setdefault(key, [])}
                out[key] += [t for t in tensors if id(t) not in seen]
        return out


def expert_zero(model: nn.Module, topology, param_groups, make_optimizer, stage: int, zero, norm_axes=None,
                param_axes=None, precision: PrecisionConfig | None = None, device: torch.device | None = None,
                manual: bool = False) -> ExpertZeroDataParallel:
    """The ZeRO / master-weight path of ``parallelize`` for ep > 1 (experts already sharded over ep):
    ``param_groups`` may be a callable ``model -> groups`` (called now, after the experts were replaced).
    ``precision``: parameter and reduction dtypes (default fp32); ``device``: where ZeRO-3 gathers."""
    if callable(param_groups):
        param_groups = param_groups(model)
    precision = precision or PrecisionConfig()
    device = device or topology.device

    def make_part(groups, shard, replicate, axes, frozen):
        return build_engine(model, groups, make_optimizer, shard, replicate, stage, zero, precision, device,
                            TransformerBlock, axes, param_axes, manual, frozen)

    edp = topology.group("edp_cp" if topology.size("cp") > 1 else "edp")  # cp ranks see other tokens
    experts = ((CommGroup.single("dp_shard", topology.ledger, topology.device), edp) if stage == 0 else
               (edp, CommGroup.single("dp_replicate", topology.ledger, topology.device)))
    return ExpertZeroDataParallel(model, param_groups, make_optimizer, make_part, dense_groups(topology, stage),
                                  experts, topology.group("ep"), norm_axes=norm_axes)
