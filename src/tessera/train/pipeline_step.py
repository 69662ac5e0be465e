"""The trainer's adapter to pipeline parallelism: one optimizer step of a pipelined Transformer
(pp × dp × tp × cp, with ZeRO and mixed precision over the data-parallel side).

``PipelineStep`` mirrors what ``tessera.train.step`` does for an unpipelined model, with the same token
weighting (every micro-batch's summed token loss divided by the global token count over all micro-batches
and data-parallel ranks, dp × cp), so a pipelined run computes the same losses and gradients as one
process. Each stage is prepared by ``tessera.train.pipeline_stage`` (tensor parallelism, ...) after the
pipeline split; the last stage's loss is vocabulary-parallel under tp.

The data-parallel side follows ``tessera.parallelize.engine_holds_optimizer``: with ZeRO (stage 1 or 2)
or below-fp32 precision a ZeRO engine in manual mode holds the optimizer over fp32 master weights
(stage 0: master weights only, replicated); otherwise plain fp32 DDP is the data-parallel reducer in
manual mode; under ep the expert engines (dense gradients over dp, expert gradients over edp). Either way
the schedule's many backwards accumulate gradients (ZeRO-3: in each unit's flat gradient) and they are
reduced ONCE per step, after the last micro-batch's backward (ZeRO-2: one reduce-scatter per bucket of
the accumulated gradients, then the full gradients are dropped). ZeRO-3's units are re-gathered for each
micro-batch's forward and backward (``zero.reshard_after_forward``) or stay gathered through the step.

Per step, on every rank (collectives in the same order everywhere)::

    result = ps.forward_backward(batches, loss_scale=S)  # pipeline step, tied grads summed, dp reduction
    # flush schedules and 2BW, with an engine (ZeRO / mixed precision):
    norm, finite = ps.engine.clip_grad_norm(max_norm, 1 / S); ps.engine.step() if finite
    # ... without one (fp32 DDP):
    finite = ps.unscale_gradients(1 / S); norm = ps.clip_grad_norm(max_norm); ps.step()
    # PipeDream async: the updates happened inside the schedule (``ps.last_grad_norm``, ``ps.skipped_inside``)
    scheduler.step(); ps.zero_grad()

Communication: forward and backward p2p on "pp" (executor.py; the pp group's ranks share a tp
coordinate), in ``precision.dtype``; tp collectives inside each stage; after the step, one exchange of
the tied embedding gradient between the first and last pp rank, this stage's gradients reduced over
dp × cp once (DDP: all-reduced in ``ddp.bucket_mb`` buckets; ZeRO: reduce-scattered in ``zero.bucket_mb``
buckets in ``precision.reduce_dtype``, the updated slices all-gathered after the step), the loss
broadcast from the last stage over "pp" and summed over dp × cp; clipping (``tessera.grad_norm``) sums
one float over "pp" and one over "tp" (and the shard group under ZeRO); an overflow check (loss scaling)
spans the world. Shapes: x_BS, y_BS token ids; activation_BsD between stages (s = S, or S/tp under SP).
"""

from __future__ import annotations

import contextlib
import math
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
from tessera.models.layers import TransformerBlock
from tessera.moe import expert_parallelize, expert_zero
from tessera.parallelize import data_parallel_group, engine_holds_optimizer, norm_axes, sharded_axes
from tessera.pipeline import Pipeline, PipelineConfig, build_pipeline
from tessera.precision import PrecisionConfig, unscale_
from tessera.timeline import Timeline, bubble_fraction, gather, write_chrome_trace, write_gantt_png
from tessera.train.optim import OptimConfig, build_optimizer, optimizer_factory, param_groups
from tessera.train.pipeline_lookahead import LookAhead, drains_after
from tessera.train.pipeline_keys import StageKeys
from tessera.train.pipeline_stage import sequence_split, stage_preparer
from tessera.train.step import IGNORE_INDEX, StepResult, global_token_count
from tessera.train.strategies import loss_function
from tessera.zero import ZeroConfig
from tessera.zero.build import shard_model


class PipelineStep:
    """This rank's stages of ``model`` (a seeded reference Transformer identical on every rank, real or on
    the meta device: then each stage is allocated on ``device`` only after its model-side strategies, and
    under ZeRO-3 only the engine's shards are), run by the schedule of ``cfg`` over the topology's "pp"
    group, replicated over its data-parallel ranks (dp × cp).

    The adapter owns its optimizer (``self.optimizer``, ``optim_cfg.name`` over this rank's stage
    parameters, or the engine's over its master shards): PipeDream async updates inside the schedule,
    after every micro-batch's backward, so the optimizer must be reachable from the pipeline. The other
    keyword arguments are the job's config sections, handed to the stage preparer
    (``tessera.train.pipeline_stage``) as one settings namespace. ``mode_exchanges``: a data-parallel
    mode other than "allreduce" (``ddp.mode``) is built over ``self.module`` and ``self.dp`` and exchanges
    at the step; the adapter then builds no reducer, engine or optimizer (``_axes_of``: the norm's rule).
    """

    @classmethod
    def for_job(cls, job, topology, model: nn.Module, device: torch.device, zero, mode_exchanges: bool = False):
        """The pipeline of ``job`` (a JobConfig) over ``topology``, with its resolved ZeRO settings ``zero``."""
        return cls(model, job.pipeline, topology, device, job.optim, tensor_parallel=job.tensor_parallel, zero=zero,
                   ddp=job.ddp, precision=job.precision, context_parallel=job.context_parallel,
                   checkpointing=job.checkpointing, model_config=job.model, moe=job.moe, kernels=job.kernels,
                   mode_exchanges=mode_exchanges)

    def __init__(self, model: nn.Module, cfg: PipelineConfig, topology, device: torch.device | str,
                 optim_cfg: OptimConfig, tensor_parallel=None, zero=None, ddp=None, precision=None,
                 context_parallel=None, checkpointing=None, model_config=None, moe=None, kernels=None,
                 mode_exchanges: bool = False):
        self.cfg, self.optim_cfg, self.device = cfg, optim_cfg, torch.device(device)
        self.adamw = kernels.adamw if kernels is not None else "auto"  # [kernels] adamw of every optimizer
        self.topology = topology
        self.precision = precision or PrecisionConfig()
        self.pp: CommGroup = topology.group("pp")
        # the ranks with different tokens and the same parameters: dp × cp ("dp" itself when cp = 1, so
        # the communication ledger names its collectives as before)
        self.dp: CommGroup = data_parallel_group(topology) if topology.size("cp") > 1 else topology.group("dp")
        sizes = {a: topology.size(a) for a in ("pp", "dp", "tp", "cp")}
        if math.prod(sizes.values()) != topology.world_size:
            raise ConfigError("pipeline parallelism composes with data, tensor and context parallelism here, "
                              f"but {' x '.join(f'{a}={n}' for a, n in sizes.items())} != "
                              f"{topology.world_size} ranks.")
        self._loss_parts = loss_function(topology)  # vocabulary-parallel under tp
        self.steps_inside = cfg.schedule == "pipedream"  # the schedule itself calls optimizer.step()
        self.timeline = Timeline(self.pp.rank, enabled=cfg.timeline)
        self._divisor = 1.0  # loss_fn divides each micro-batch's summed loss by this (the global tokens)
        self._sums: list[torch.Tensor] = []  # summed token loss per micro-batch, on the last stage's rank
        self._loss_scale = 1.0  # forward_backward's loss scale (the in-schedule updates divide it out)
        settings = SimpleNamespace(tensor_parallel=tensor_parallel, context_parallel=context_parallel,
                                   checkpointing=checkpointing, precision=self.precision,
                                   model=model_config if model_config is not None else model.cfg, moe=moe,
                                   kernels=kernels)
        prepare = stage_preparer(topology, settings, self.loss_weight, self.device)
        self.pipe: Pipeline = build_pipeline(model, cfg, self.pp, self._loss_fn, self.device, self.timeline,
                                             on_step=self._on_step if self.steps_inside else None,
                                             prepare_stage=prepare, seq_split=sequence_split(topology, settings),
                                             activation_dtype=self.precision.param_dtype)
        self.module = _rank_module(self.pipe)
        self.keys = self.pipe.executor.before_compute = StageKeys(self.pipe.stages)  # MoE: rows, padding
        # the tied embedding's two copies sum their gradients, unless it is frozen (LoRA): then it has none
        embedding = getattr(model, "tok_embeddings", None)
        self._tied_grads = self.pipe.tied and embedding is not None and embedding.weight.requires_grad
        self._axes_of = self._param_axes()
        if mode_exchanges:  # a ddp.mode (tessera.train.dp_modes) exchanges over self.dp at the step and holds
            self.engine = self.reducer = self.optimizer = None  # the optimizer: this reduces nothing
        else:
            self._data_parallel(zero or ZeroConfig(), ddp or DDPConfig())
        self.skipped_inside = 0  # PipeDream async: in-schedule updates of the last batch skipped on inf/nan
        # pipeline.flush = false: the next step's batches, fetched a step early so its first forwards fill
        # this step's cool-down (``take_batches``), and the global token count of those forwards' step
        self.lookahead = LookAhead(enabled=not cfg.flush and self.pp.size > 1)
        self.last_grad_norm = 0.0  # PipeDream async: the norm before the last in-schedule clipping

    def loss_weight(self) -> float:
        """What a stage's own loss terms (MoE auxiliary losses) are multiplied by before backward, as the
        token loss is: the loss scale over the global token count of the step the running forward is of
        (without a flush the next step's first forwards run in this one: micro-batch numbers m..)."""
        a = self.pipe.executor.current
        ahead = a is not None and a.mb >= self.pipe.schedule.n_microbatches
        return self._loss_scale / (self.lookahead.divisor if ahead else self._divisor)

    def take_batches(self, fetch, drain: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This step's batches (``fetch()`` gives the sampler's next step); with ``pipeline.flush = false``
        and no ``drain`` after this step, the next step's too, whose first forwards run in this step
        (``tessera.train.pipeline_lookahead.LookAhead.take_batches``)."""
        return self.lookahead.take_batches(fetch, drain)

    drains_after = staticmethod(drains_after)  # (step, job) -> whether the pipeline drains after ``step``

    def _data_parallel(self, zero: ZeroConfig, ddp: DDPConfig) -> None:
        """The reduction of this stage's gradients over dp × cp, in manual mode (the schedule runs many
        backwards; ``_reduce_grads`` reduces once per step). Under ``engine_holds_optimizer`` (ZeRO, or
        below-fp32 precision with fp32 master weights) the ZeRO engine of ``shard_model``, which replaces
        the optimizer (ZeRO-1/2: buckets of the data-parallel reducer, reduce-scattered; ZeRO-3: one unit
        per layer, embedding and head, each unit's accumulated flat gradient reduce-scattered); else the
        data-parallel reducer's all-reduce (sum) in ``ddp.bucket_mb`` buckets, with
        ``ddp.find_unused_parameters``. Under ep (experts already split over "ep" by the stage preparer)
        the expert engines: dense gradients over dp × cp, expert gradients over edp × cp."""
        self.engine = self.reducer = None
        ep = self.topology.size("ep") > 1
        if engine_holds_optimizer(self.topology.config, self.precision):
            groups, make = param_groups(self.module, self.optim_cfg), optimizer_factory(self.optim_cfg, self.adamw)
            axes, stage = norm_axes(self.topology, pipeline=True), self.topology.config.zero_stage
            if ep:
                self.engine = expert_zero(self.module, self.topology, groups, make, stage, zero, axes, self._axes_of,
                                          precision=self.precision, device=self.device, manual=True)
            else:  # ZeRO-3: a unit per layer, the embedding and the head
                self.engine = shard_model(self.module, groups, make, self.topology, stage, zero, self.precision,
                                          self.device, block_class=TransformerBlock, norm_axes=axes,
                                          param_axes=self._axes_of, manual=True)
            self.optimizer = self.engine.optimizer
            return
        self.optimizer = build_optimizer(self.module, self.optim_cfg, self.adamw)
        if ep:  # the experts are split already (the stage preparer); this picks dp(×cp) and edp(×cp)
            self.reducer = expert_parallelize(self.module, self.topology, ddp, manual=True)
        elif self.dp.size > 1:
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
        # The token loss is divided by THIS step's global token count (``_divisor``) and summed into this
        # step's ``_sums``. That is right only because the last stage, the one that computes the loss, never
        # runs a look-ahead forward (micro-batch number >= m, the next step's: ``pipeline.flush = false``):
        # the continuing schedules give those forwards to the earlier stages' cool-down slots only. A
        # schedule that broke this would silently weight the next step's loss by this step's tokens.
        a = self.pipe.executor.current  # None outside the training executor (evaluation)
        assert a is None or a.mb < self.pipe.schedule.n_microbatches, \
            f"the last stage ran a look-ahead forward (micro-batch {a.mb}); its loss would use this step's tokens"
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

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], activation_tracker=None,
                         loss_scale: float = 1.0, rows: tuple[int, int, int] | None = None) -> StepResult:
        """Gradients of the global-mean loss over this dp rank's ``batches`` (summed over "dp" afterwards;
        PipeDream async has already applied them). The returned loss is the same float on every rank.
        ``loss_scale`` multiplies the loss before backward (see :meth:`unscale_gradients`); the reported
        loss is unscaled. ``rows``: (run seed, the run's sample index of this rank's first row, rows per
        step) names the micro-batches' tokens for MoE noise (``tessera.train.pipeline_keys``)."""
        total_tokens = global_token_count(batches, self.dp, self.device)
        self._divisor, self._sums = float(total_tokens), []
        self._loss_scale, self.skipped_inside = loss_scale, 0
        micro = self._split(batches)
        self.keys.begin(rows, len(micro))
        ahead = self.lookahead.take_ahead()  # take_batches' next step (flush = false)
        look = None if ahead is None else self._split(ahead)
        if ahead is not None:
            self.lookahead.divisor = float(global_token_count(ahead, self.dp, self.device))
        if self.pipe.executor.drained:  # keep the last step (no flush: the steps since the last drain)
            self.timeline.clear()
        tracking = activation_tracker() if activation_tracker else contextlib.nullcontext()
        with tracking:  # every micro-batch in flight at once on this rank counts
            if not self._tied_grads:
                self.pipe.executor.step(micro, look)  # the schedule alone
            elif getattr(self.engine, "flats", None):  # ZeRO-3 (also under ep)
                self.pipe.executor.step(micro, look)
                self._sum_tied_flat_grads()
            else:
                self.pipe.step(micro, look)  # the schedule, then the tied copies' .grad summed
        self.keys.end()
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

    def _sum_tied_flat_grads(self) -> None:
        """ZeRO-3: the stage modules hold views of their units' flat parameters, and gradients accumulate
        in the flat gradient [P], not in a ``.grad``: sum the tied embedding's two copies there (the
        first stage's embedding on pp rank 0, the last stage's head on rank pp-1; one exchange each way),
        in stage order on both ranks so the copies stay bit-identical."""
        mine = []
        if 0 in self.pipe.stages:
            mine.append(("tok_embeddings.weight", self.pp.size - 1))
        if self.pipe.schedule.n_stages - 1 in self.pipe.stages:
            mine.append(("output.weight", 0))
        for name, peer in mine:
            flat = next(f for f in self.engine.flats if name in f.names)
            if flat.full.grad is None:  # no micro-batch reached it: its gradient is zeros
                flat.full.grad = torch.zeros(flat.size, dtype=flat.full.dtype, device=flat.full.device)
            i = flat.names.index(name)
            g = flat.full.grad[flat.offsets[i]: flat.offsets[i] + flat.shapes[i].numel()]
            other = torch.empty_like(g)
            for h in comm.batch_isend_irecv([comm.P2POp("send", g.clone(), peer),
                                             comm.P2POp("recv", other, peer)], self.pp):
                h.wait()
            g.copy_(g + other if self.pp.rank == 0 else other + g)

    def _reduce_grads(self) -> None:
        """Reduce this stage's accumulated gradients over dp × cp in buckets, once (ZeRO: reduce-scatter
        each bucket, this rank keeps its slice). A stage parameter no micro-batch reached counts as zeros,
        or, with ``ddp.find_unused_parameters``, keeps ``grad = None`` when no rank has a gradient for it."""
        if self.engine is not None:
            self.engine.reduce_gradients()
        elif self.reducer is not None:
            self.reducer.reduce_gradients()

    def unscale_gradients(self, inv_scale: float) -> bool:
        """Without an engine: divide this stage's reduced gradients by the loss scale (``inv_scale`` =
        1/S) and return whether every rank's are finite (one flag all-reduced over the world group). With
        ``steps_inside`` the in-schedule updates did that already: whether none of them was skipped (no
        communication). A step with some updates skipped and the others applied is then reported as
        skipped (``skipped_at`` in metrics.jsonl, and the scale is lowered once), although those other
        updates did happen."""
        if self.steps_inside:
            return self.skipped_inside == 0
        return self._unscale(inv_scale)

    def _unscale(self, inv_scale: float) -> bool:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return unscale_(grads, inv_scale, [self.topology.group("world")], self.device)

    def _on_step(self) -> None:
        """PipeDream async: one update after every micro-batch's backward (the schedule's STEP action),
        through the engine when there is one; with a loss scale, an update whose gradients overflowed on
        any rank is skipped on every rank."""
        self._reduce_grads()
        if self.engine is not None:
            norm, finite = self.engine.clip_grad_norm(self.optim_cfg.grad_clip, inv_scale=1.0 / self._loss_scale)
            if finite:
                self.last_grad_norm = norm
                self.engine.step()
            self.skipped_inside += not finite
            self.engine.zero_grad()
            return
        if self._loss_scale != 1.0 and not self._unscale(1.0 / self._loss_scale):
            self.skipped_inside += 1
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.last_grad_norm = clip_grad_norm(self.parameters(), norm_axes(self.topology, pipeline=True),
                                             self.optim_cfg.grad_clip, axes_of=self._axes_of, device=self.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Without an engine: clip by the global L2 norm over every stage (squares summed over "pp"; the
        tied head's copy of the embedding counted once) and return the norm before clipping. ``max_norm``
        0 only measures. With ``steps_inside`` the updates are done and clipped already (by
        ``optim_cfg.grad_clip``): this returns the last of those norms and communicates nothing (the same
        on every rank). An engine clips in ``engine.clip_grad_norm(max_norm, inv_scale)``."""
        if self.steps_inside:
            return self.last_grad_norm
        # the job-wide rule (``tessera.grad_norm``): stage parameters split over pp, tp-split weights over
        # tp too (``_param_axes``); one all-reduce per axis
        return clip_grad_norm(self.parameters(), norm_axes(self.topology, pipeline=True), max_norm,
                              axes_of=self._axes_of, device=self.device)

    def step(self) -> None:
        """The optimizer step after ``clip_grad_norm`` (an engine is stepped by the trainer)."""
        self.optimizer.step()

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
        self.keys.begin(None, 1)  # no noise in evaluation; padding is marked all the same
        try:
            for micro in batches:
                self._sums = []
                totals[0] += self.pipe.evaluate(micro).to(self.device)
                totals[1] += sum(int(y.ne(IGNORE_INDEX).sum()) for _, y in micro)
        finally:
            self.keys.end()
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
