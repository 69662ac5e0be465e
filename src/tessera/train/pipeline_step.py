"""The trainer's adapter to pipeline parallelism: one optimizer step of a pipelined Transformer
(pp × dp × tp, with ZeRO-1 over dp optionally).

``PipelineStep`` mirrors what ``tessera.train.step`` does for an unpipelined model, with the same token
weighting (every micro-batch's summed token loss divided by the global token count over all micro-batches
and data-parallel ranks), so a pipelined run computes the same losses and gradients as one process.
Under tp each stage is split by Megatron 1D tensor parallelism (+SP) after the pipeline split, and the
last stage's loss is vocabulary-parallel.

Per step, on every rank (collectives in the same order everywhere)::

    result = ps.forward_backward(batches)      # pipeline step, tied grads summed, dp reduction
    finite = ps.unscale_gradients(1 / S)       # only with a loss scale S: skip the update unless finite
    norm = ps.clip_grad_norm(max_norm)         # PipeDream async: the norm its in-schedule updates clipped
    if not ps.steps_inside:                    # flush schedules and 2BW: the trainer updates
        ps.step()                              # the optimizer, or ZeRO-1's sharded update + all-gather
    scheduler.step(); ps.zero_grad()

Communication: forward and backward p2p on "pp" (executor.py; the pp group's ranks share a tp
coordinate); tp collectives inside each stage; after the step, one exchange of the tied embedding
gradient between the first and last pp rank, this stage's gradients summed over "dp" in buckets of
``ddp.bucket_mb`` by the data-parallel reducer in manual mode (ZeRO-1: reduce-scattered in
``zero.bucket_mb`` buckets, then the updated slices all-gathered), the loss broadcast from the
last stage over "pp" and summed over "dp"; clipping (``tessera.grad_norm``) sums one float over "pp"
and one over "tp" (and "dp" under ZeRO-1). Shapes: x_BS, y_BS token ids; activation_BsD between stages
(s = S, or S/tp under SP).
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Iterator

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.data_parallel import AllReduce, DDPConfig, GradReducer, build_buckets
from tessera.errors import ConfigError
from tessera.grad_norm import clip_grad_norm
from tessera.parallelize import norm_axes, sharded_axes
from tessera.pipeline import Pipeline, PipelineConfig, build_pipeline
from tessera.precision import PrecisionConfig, unscale_
from tessera.timeline import Timeline, bubble_fraction, gather, write_chrome_trace, write_gantt_png
from tessera.train.optim import OptimConfig, build_optimizer, optimizer_factory, param_groups
from tessera.train.pipeline_stage import sequence_split, stage_preparer
from tessera.train.step import IGNORE_INDEX, StepResult, global_token_count
from tessera.train.strategies import loss_function
from tessera.zero import ZeroConfig
from tessera.zero.build import shard_model

class PipelineStep:
    """This rank's stages of ``model`` (a seeded reference Transformer identical on every rank), run by the
    schedule of ``cfg`` over the topology's "pp" group, replicated over its "dp" group.

    The adapter owns its optimizer (``self.optimizer``, AdamW from ``optim_cfg`` over this rank's stage
    parameters, as ZeRO engines own theirs): PipeDream async updates inside the schedule, after every
    micro-batch's backward, so the optimizer must be reachable from the pipeline.
    """

    def __init__(self, model: nn.Module, cfg: PipelineConfig, topology, device: torch.device | str,
                 optim_cfg: OptimConfig, tensor_parallel=None, zero=None, ddp=None):
        self.cfg, self.optim_cfg, self.device = cfg, optim_cfg, torch.device(device)
        self.topology = topology
        self.pp: CommGroup = topology.group("pp")
        self.dp: CommGroup = topology.group("dp")
        self.tp: CommGroup = topology.group("tp")
        if self.pp.size * self.dp.size * self.tp.size != topology.world_size:
            raise ConfigError(f"pipeline parallelism composes with data and tensor parallelism here, but pp="
                              f"{self.pp.size} x dp={self.dp.size} x tp={self.tp.size} != "
                              f"{topology.world_size} ranks.")
        self._loss_parts = loss_function(topology)  # vocabulary-parallel under tp
        self.steps_inside = cfg.schedule == "pipedream"  # the schedule itself calls optimizer.step()
        self.timeline = Timeline(self.pp.rank, enabled=cfg.timeline)
        self._divisor = 1.0  # loss_fn divides each micro-batch's summed loss by this (the global tokens)
        self._sums: list[torch.Tensor] = []  # summed token loss per micro-batch, on the last stage's rank
        settings = SimpleNamespace(tensor_parallel=tensor_parallel)
        prepare = stage_preparer(topology, settings, lambda: self._loss_scale / self._divisor)
        self.pipe: Pipeline = build_pipeline(model, cfg, self.pp, self._loss_fn, self.device, self.timeline,
                                             on_step=self._on_step if self.steps_inside else None,
                                             prepare_stage=prepare, seq_split=sequence_split(topology, settings))
        self.module = _rank_module(self.pipe)
        self._axes_of = self._param_axes()
        self._data_parallel(zero or ZeroConfig(), ddp or DDPConfig())
        self._loss_scale = 1.0  # forward_backward's loss scale (the in-schedule updates divide it out)
        self.skipped_inside = 0  # PipeDream async: in-schedule updates of the last batch skipped on inf/nan
        self.last_grad_norm = 0.0  # PipeDream async: the norm before the last in-schedule clipping

    def _data_parallel(self, zero: ZeroConfig, ddp: DDPConfig) -> None:
        """The reduction of this stage's gradients over "dp", in manual mode (the schedule runs many
        backwards; ``_reduce_grads`` reduces once per step): ZeRO-1's sharded engine, which replaces the
        optimizer, or the data-parallel reducer's all-reduce (sum) in ``ddp.bucket_mb`` buckets, with
        ``ddp.find_unused_parameters``. Both are ``tessera.data_parallel.reducer.GradReducer``."""
        self.engine = self.reducer = None
        if self.topology.config.zero_stage == 1:
            self.engine = shard_model(self.module, param_groups(self.module, self.optim_cfg),
                                      optimizer_factory(self.optim_cfg), self.topology, 1, zero,
                                      PrecisionConfig(), self.device,
                                      norm_axes=norm_axes(self.topology, pipeline=True),
                                      param_axes=self._axes_of, manual=True)
            self.optimizer = self.engine.optimizer
            return
        self.optimizer = build_optimizer(self.module, self.optim_cfg)
        if self.dp.size > 1:
            params = [p for p in self.parameters() if p.requires_grad]
            buckets = build_buckets(list(reversed(params)), int(ddp.bucket_mb * 2**20))
            # the buffers are dropped after each reduction (the gradients live on as views until the
            # optimizer clears them), so no flat copy of the gradients persists between steps
            self.reducer = GradReducer(buckets, AllReduce(self.dp, "sum", releases=True), hooks=False,
                                       find_unused=ddp.find_unused_parameters, group=self.dp)

    # ---- parameters --------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stage parameters (every virtual stage it holds)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's stage parameters under the full model's names (e.g. ``layers.3.attention.wq.weight``)."""
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the full model's names (the tied head as ``output.weight``)."""
        return self.pipe.state_dict()

    # ---- one optimizer step ------------------------------------------------------------------------

    def _loss_fn(self, logits_BSV: torch.Tensor, y_BS: torch.Tensor) -> torch.Tensor:
        s, _ = self._loss_parts(logits_BSV, y_BS, ignore_index=IGNORE_INDEX)
        self._sums.append(s.detach().double())
        scaled = s / torch.as_tensor(self._divisor, dtype=s.dtype)
        return scaled * self._loss_scale if self._loss_scale != 1.0 else scaled

    def _split(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rank's whole batch (the sampler's micro-batches concatenated) cut into the schedule's count."""
        x_BS = torch.cat([x for x, _ in batches])
        y_BS = torch.cat([y for _, y in batches])
        m = self.pipe.schedule.n_microbatches
        if x_BS.shape[0] % m:
            raise ConfigError(f"pipeline.microbatches={m} does not divide this rank's batch of "
                              f"{x_BS.shape[0]} sequences.")
        return list(zip(x_BS.chunk(m), y_BS.chunk(m)))

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         activation_tracker=None, loss_scale: float = 1.0) -> StepResult:
        """Gradients of the global-mean loss over this dp rank's ``batches`` (summed over "dp" afterwards;
        PipeDream async has already applied them). The returned loss is the same float on every rank.
        ``loss_scale`` multiplies the loss before backward (see :meth:`unscale_gradients`); the reported
        loss is unscaled."""
        total_tokens = global_token_count(batches, self.dp, self.device)
        self._divisor, self._sums = float(total_tokens), []
        self._loss_scale, self.skipped_inside = loss_scale, 0
        micro = self._split(batches)
        self.timeline.clear()  # keep the last step only: write_timeline measures it
        tracking = activation_tracker() if activation_tracker else contextlib.nullcontext()
        with tracking:  # every micro-batch in flight at once on this rank counts
            self.pipe.step(micro)
        if not self.steps_inside:
            self._reduce_grads()
        loss = self._broadcast_loss()
        comm.all_reduce(loss, self.dp)
        return StepResult(loss=float(loss / total_tokens), tokens=int(total_tokens))

    def _broadcast_loss(self) -> torch.Tensor:
        """This dp replica's summed token loss (float64), from the last stage's rank to every pp rank."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for s in self._sums:
            total += s
        last = self.pipe.schedule.rank_of(self.pipe.schedule.n_stages - 1)
        comm.broadcast(total, self.pp, src=last)
        return total

    def _reduce_grads(self) -> None:
        """Sum this stage's gradients over "dp" in buckets (ZeRO-1: reduce-scatter each bucket, this rank
        keeps its slice). A stage parameter no micro-batch reached counts as zeros, or, with
        ``ddp.find_unused_parameters``, keeps ``grad = None`` when no dp rank has a gradient for it."""
        if self.engine is not None:
            self.engine.reduce_gradients()
        elif self.reducer is not None:
            self.reducer.reduce_gradients()

    def unscale_gradients(self, inv_scale: float) -> bool:
        """Divide this stage's reduced gradients by the loss scale (``inv_scale`` = 1/S) and return whether
        every rank's are finite (one flag all-reduced over the world group). With ``steps_inside`` the
        in-schedule updates did that already: whether none of them was skipped (no communication). A step
        with some updates skipped and the others applied is then reported as skipped (``skipped_at`` in
        metrics.jsonl, and the scale is lowered once), although those other updates did happen."""
        if self.steps_inside:
            return self.skipped_inside == 0
        return self._unscale(inv_scale)

    def _unscale(self, inv_scale: float) -> bool:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return unscale_(grads, inv_scale, [self.topology.group("world")], self.device)

    def _on_step(self) -> None:
        """PipeDream async: one update after every micro-batch's backward (the schedule's STEP action);
        with a loss scale, an update whose gradients overflowed on any rank is skipped on every rank."""
        self._reduce_grads()
        if self._loss_scale != 1.0 and not self._unscale(1.0 / self._loss_scale):
            self.skipped_inside += 1
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.last_grad_norm = clip_grad_norm(self.parameters(), norm_axes(self.topology, pipeline=True),
                                             self.optim_cfg.grad_clip, axes_of=self._axes_of, device=self.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the global L2 norm over every stage (squares summed over "pp"; the tied head's copy of
        the embedding counted once) and return the norm before clipping. ``max_norm`` 0 only measures.
        With ``steps_inside`` the updates are done and clipped already (by ``optim_cfg.grad_clip``): this
        returns the last of those norms and communicates nothing (the same on every rank)."""
        if self.steps_inside:
            return self.last_grad_norm
        if self.engine is not None:
            return self.engine.clip_grad_norm(max_norm)[0]
        # the job-wide rule (``tessera.grad_norm``): stage parameters split over pp, tp-split weights over
        # tp too (``_param_axes``); one all-reduce per axis
        return clip_grad_norm(self.parameters(), norm_axes(self.topology, pipeline=True), max_norm,
                              axes_of=self._axes_of, device=self.device)

    def step(self) -> None:
        """The optimizer step after ``clip_grad_norm`` (ZeRO-1: update the slices, all-gather over dp)."""
        (self.engine or self.optimizer).step()

    def zero_grad(self) -> None:
        if self.engine is not None:
            self.engine.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _param_axes(self):
        """``axes_of(p)``: "pp" for every stage parameter except the tied embedding and head (two
        copies of one weight on pp ranks 0 and pp-1: replicated, so counted on pp rank 0 only), plus
        "tp" for tensor-parallel splits."""
        tp_axes = sharded_axes(self.module, self.topology)
        sched, tied = self.pipe.schedule, set()
        first, last = self.pipe.stages.get(0), self.pipe.stages.get(sched.n_stages - 1)
        if self.pipe.tied and sched.n_stages > 1:
            tied = {id(m.weight) for m in (first and first.tok_embeddings, last and last.output) if m is not None}
        return lambda p: tp_axes(p) | (frozenset() if id(p) in tied else frozenset(("pp",)))

    # ---- evaluation --------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> float:
        """Mean token loss over this dp rank's validation batches (lists of micro-batches), over all dp
        ranks: the same float on every rank (forward-only schedule; live weights)."""
        modes = [m.training for m in self.pipe.stages.values()]
        for m in self.pipe.stages.values():
            m.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, token count]
        self._divisor, self._loss_scale = 1.0, 1.0
        try:
            for micro in batches:
                self._sums = []
                totals[0] += self.pipe.evaluate(micro).to(self.device)
                totals[1] += sum(int(y.ne(IGNORE_INDEX).sum()) for _, y in micro)
        finally:
            for m, mode in zip(self.pipe.stages.values(), modes):
                m.train(mode)
        comm.all_reduce(totals, self.dp)
        return float(totals[0] / totals[1])

    # ---- timeline ----------------------------------------------------------------------------------

    def write_timeline(self, run_dir) -> dict:
        """Collective over "pp": gather the last step's Timeline; global rank 0 writes ``trace.json``
        (Chrome trace) and ``timeline.png`` (Gantt) into ``run_dir``. Returns ``{"bubble_fraction": b}`` on
        every rank ({} when ``pipeline.timeline`` is off)."""
        if not self.timeline.enabled:
            return {}
        events = gather(self.timeline, self.pp)
        bubble, _ = bubble_fraction(events, self.pp.size)
        if self.pp.global_rank == 0:
            write_chrome_trace(os.path.join(run_dir, "trace.json"), events)
            title = f"{self.cfg.schedule} pp={self.pp.size} m={self.pipe.schedule.n_microbatches}"
            write_gantt_png(os.path.join(run_dir, "timeline.png"), events, title, bubble)
        return {"bubble_fraction": bubble}


def _rank_module(pipe: Pipeline) -> nn.Module:
    """One nn.Module over this rank's stages whose parameter names are the full model's: the stages'
    ``layers`` merged into one ModuleDict, plus the embedding / norm / head where this rank holds them
    (shared, not copied). Checkpoints (DCP) and memory accounting take it as the model."""
    holder = nn.Module()
    holder.tie_embeddings = pipe.tied  # checkpoints name the last stage's head as the tied embedding
    holder.layers = nn.ModuleDict()
    for s in sorted(pipe.stages):
        stage = pipe.stages[s]
        for key, layer in stage.layers.items():
            holder.layers[key] = layer
        for name in ("tok_embeddings", "norm", "output"):
            if getattr(stage, name, None) is not None:
                setattr(holder, name, getattr(stage, name))
    return holder
