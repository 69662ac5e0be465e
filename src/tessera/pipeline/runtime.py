"""The reference Transformer as a pipeline: partition, stage modules, schedule, executor, tied weights.

What a trainer calls per optimizer step (every pp rank gets the same micro-batches)::

    pipe = build_pipeline(model, cfg, topo.group("pp"), loss_fn, device, timeline)
    opt = AdamW(pipe.parameters(), ...)
    out = pipe.step(micro_batches)   # F/B of every micro-batch by the schedule; tied grads summed
    all_reduce each grad over "dp"   # data parallelism composes after the pipeline step
    opt.step(); opt.zero_grad()

Tied embeddings: the first stage's ``tok_embeddings.weight`` and the last stage's ``output.weight`` start
equal (copied from one model) and stay equal because their gradients are summed after every step (forward:
nothing; backward: one exchange between pp ranks 0 and pp-1).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.pipeline.checker import check, verify_complete
from tessera.pipeline.config import PipelineConfig
from tessera.pipeline.executor import PipelineExecutor, StepOutput
from tessera.pipeline.partition import partition_transformer, stage_modules
from tessera.pipeline.schedules import Schedule, build_schedule, forward_only
from tessera.timeline import Timeline


class Pipeline:
    """This rank's share of a pipelined Transformer."""

    def __init__(self, executor: PipelineExecutor, partition: list[list[int]], tied: bool):
        self.executor, self.partition, self.tied = executor, partition, tied
        self.stages = executor.stages
        self.schedule: Schedule = executor.schedule
        self.pp = executor.pp
        self._eval: dict[int, PipelineExecutor] = {}  # forward-only executors by micro-batch count

    def parameters(self):
        return self.executor.parameters()

    def named_parameters(self):
        for module in self.stages.values():
            yield from module.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the full model's names (tied head named ``output.weight``)."""
        out = {}
        for module in self.stages.values():
            out.update({k: v for k, v in module.state_dict().items()})
        return out

    def step(self, micro_batches: list[tuple[Any, Any]], lookahead: list[tuple[Any, Any]] | None = None
             ) -> StepOutput:
        """One step; ``lookahead`` (``flush = false``): the next step's micro-batches (PipelineExecutor.step)."""
        result = self.executor.step(micro_batches, lookahead)
        if self.tied:
            self.sync_tied_grads()
        return result

    def sync_tied_grads(self) -> None:
        """Sum the gradients of the embedding (stage 0, pp rank 0) and head (last stage, rank pp-1)."""
        n, pp = self.schedule.n_stages, self.pp.size
        if pp == 1:
            return  # one module holds both: they are the same Parameter
        mine = []
        if 0 in self.stages:
            mine.append((self.stages[0].tok_embeddings.weight, pp - 1))
        if n - 1 in self.stages:
            mine.append((self.stages[n - 1].output.weight, 0))
        for p, peer in mine:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            other = torch.empty_like(g)
            handles = comm.batch_isend_irecv([comm.P2POp("send", g.contiguous(), peer),
                                              comm.P2POp("recv", other, peer)], self.pp)
            for h in handles:
                h.wait()
            # Sum in stage order on both ranks, so the two copies stay bit-identical.
            p.grad = g + other if self.pp.rank == 0 else other + g

    @torch.no_grad()
    def evaluate(self, micro_batches: list[tuple[Any, Any]]) -> torch.Tensor:
        """Forward only (no weight versions, no gradients): the sum of ``loss_fn`` over the micro-batches,
        on every pp rank."""
        m = len(micro_batches)
        if not self.executor.drained:  # its sends in flight would meet the evaluation's receives
            raise RuntimeError("evaluate() needs a drained pipeline: run the last step without a lookahead")
        if m not in self._eval:
            ex = self.executor
            self._eval[m] = PipelineExecutor(ex.stages, forward_only(self.pp.size, m, self.schedule.n_stages
                                                                     // self.pp.size), self.pp, ex.loss_fn,
                                             ex.activation_shape, ex.dtype, ex.device,
                                             before_compute=ex.before_compute)
        return self.loss(self._eval[m].step(micro_batches))

    def loss(self, result: StepOutput) -> torch.Tensor:
        """Sum of the step's micro-batch losses, broadcast from the last stage's rank to every pp rank (a
        0-d float64 on the pp group's device: the other ranks' placeholder too)."""
        if result.losses:
            total = torch.stack(result.losses).sum().double().to(self.pp.device)
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.pp.device)
        comm.broadcast(total, self.pp, src=self.schedule.rank_of(self.schedule.n_stages - 1))
        return total


def build_pipeline(model: nn.Module, cfg: PipelineConfig, pp: CommGroup,
                   loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], device: torch.device | str | None = None,
                   timeline: Timeline | None = None, on_step: Callable[[], None] | None = None,
                   prepare_stage: Callable[[nn.Module], nn.Module] | None = None,
                   seq_split: int = 1, activation_dtype: torch.dtype | None = None) -> Pipeline:
    """Partition ``model`` (a full reference Transformer, identical on every pp rank), keep this rank's
    stages, build and check the schedule, and return the runnable :class:`Pipeline` on ``device`` (default:
    the pp group's device, where the activations it sends must live).

    ``prepare_stage(stage) -> stage`` transforms each stage module before it runs (e.g. tensor
    parallelism); a ``model`` on the meta device gives meta stages, which it must materialise.
    ``seq_split``: the activations between stages hold 1/seq_split of the sequence (sequence
    parallelism), activation_BsD with s = S / seq_split. ``activation_dtype``: the dtype of the
    activations and gradients sent between stages (the receive buffers), None for the model's parameter
    dtype (mixed precision passes the dtype its stages compute and exchange in)."""
    cfg.validate(pp.size, n_layers=len(model.layers))
    n_stages = pp.size * cfg.virtual_stages
    partition = partition_transformer(model, n_stages, cfg.partition, cfg.layers or None, cfg.layer_costs or None)
    schedule = build_schedule(cfg.schedule, pp.size, cfg.microbatches, cfg.virtual_stages)
    verify_complete(schedule)
    check(schedule)  # raises ScheduleError before any message is sent
    device = torch.device(device) if device is not None else pp.device
    stages = stage_modules(model, partition, pp.size, pp.rank)
    # a meta-device model's stages stay on meta: ``prepare_stage`` materialises them where they run
    stages = {s: m if _is_meta(m) else m.to(device) for s, m in stages.items()}
    if prepare_stage is not None:
        stages = {s: prepare_stage(m) for s, m in stages.items()}
    dim = model.cfg.dim

    def activation_shape(x: torch.Tensor) -> tuple[int, int, int]:
        return (x.shape[0], x.shape[1] // seq_split, dim)  # activation_BsD

    dtype = activation_dtype or next(model.parameters()).dtype
    executor = PipelineExecutor(stages, schedule, pp, loss_fn, activation_shape, dtype, device, timeline,
                                recompute=cfg.recompute, on_step=on_step, vertical_sync=cfg.vertical_sync,
                                flush=cfg.flush)
    tied = bool(getattr(model.cfg, "tie_embeddings", False))
    return Pipeline(executor, partition, tied)


def _is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())
