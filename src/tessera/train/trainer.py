"""The training loop of one rank: build everything from a JobConfig, train, validate, write the run.

Every rank runs this; collective calls happen in the same order on all of them. Only rank 0 writes
files (metrics, summary, plot), except the checkpoint, which every rank writes its part of.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tessera import comm
from tessera.comm.ledger import CommLedger
from tessera.device import peak_memory_bytes, synchronize
from tessera.lora.record import adapter_record
from tessera.precision import LossScaler
from tessera.topology import Topology
from tessera.checkpoint import prune, step_path
from tessera.train import resume
from tessera.train.checkpoint import load_training_state, save_training_state
from tessera.train.config import JobConfig, save_config
from tessera.train.data import eval_windows, load_corpus, make_batch
from tessera.train.data.bucketing import make_sampler
from tessera.train.assemble import assemble
from tessera.train.model_build import meta_model, parameter_counts  # meta_model: also imported from here
from tessera.train.update import StepUpdate
from tessera.train.memory import MemoryLedger
from tessera.train.metrics import MetricsWriter, finite
from tessera.observe.mfu import ModelFlops
from tessera.train.optim import build_scheduler
from tessera.train.rundir import resolve_run_dir
from tessera.observe.profile import StepProfiler
from tessera.train.step import evaluate, forward_backward
from tessera.observe.step_time import StepTimer, add_split, split_fields
from tessera.train.strategies import loss_function, shard_step, tokens_group
from tessera.zero.offload.check import with_offload_folder


@dataclass
class Interval:
    """What happened since the last metrics line."""

    steps: int = 0
    loss: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    grad_norm: float = 0.0
    skipped_at: list = field(default_factory=list)  # steps skipped on inf/nan gradients (loss scaling)
    time_split: dict = field(default_factory=dict)  # part -> seconds summed (train.time_breakdown; step_time)


class Trainer:
    def __init__(self, cfg: JobConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.ledger = CommLedger()
        self.topology = Topology.build(cfg.parallel, self.ledger, device)
        self.world = self.topology.group("world")
        self.dp = self.topology.group("dp")  # data-parallel coordinate: which slice of the batch
        self.is_main = self.topology.rank == 0
        torch.manual_seed(cfg.run.seed)  # the same random streams (dropout) on every rank
        self.core = meta_model(cfg)  # each rank allocates only what it holds, in parallelize / the pipeline
        self.n_params, self.n_trainable = parameter_counts(self.core)  # before ZeRO-3 / tp / ep shard them
        parts = assemble(cfg, self.topology, self.core, device,
                         with_offload_folder(cfg.zero, cfg))  # disk offload: "" becomes <run.out_dir>/offload
        self.model, self.core, self.engine = parts.model, parts.core, parts.engine  # pipeline: core = its stages
        self.pipe, self.mode, self.optimizer = parts.pipe, parts.mode, parts.optimizer
        self.tokens_group = tokens_group(self.topology, self.core)  # ranks holding different tokens: dp × cp (× nd)
        self.loss_fn = loss_function(self.topology, self.core)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.skips_hold_lr = cfg.optim.schedule.startswith("deepspeed-")  # as DeepSpeed's engine steps them
        self.scaler = LossScaler.from_config(cfg.precision)
        self.update = StepUpdate(mode=self.mode, pipe=self.pipe, engine=self.engine, core=self.core,
                                 optimizer=self.optimizer, scaler=self.scaler, topology=self.topology,
                                 world=self.world, device=device, grad_clip=cfg.optim.grad_clip)
        self.memory = MemoryLedger(self.core, self.optimizer,
                                   grad_buffers=getattr(self.model, "grad_buffers", ()),
                                   state_fn=self.engine.memory_tensors if self.engine else None)
        self.last_memory = None
        self.corpus = load_corpus(cfg.data, progress=self.is_main and cfg.run.progress)
        d = cfg.data
        self.sampler = make_sampler(self.corpus, cfg, self.dp.rank, self.dp.size, self.topology.size("tp"),
                                    self.topology.size("cp"))  # fixed windows, or length buckets
        self.eval_batches = [
            shard_step([make_batch(self.corpus.val, ids, d.seq_len) for ids in micro], self.topology, self.core)
            for micro in eval_windows(self.corpus.val, d.seq_len, d.global_batch_size, d.eval_batches,
                                      d.micro_batch_size, self.dp.rank, self.dp.size)
        ]
        self.run_dir = resolve_run_dir(cfg, self.topology, device)
        self.metrics = MetricsWriter(self.run_dir, cfg.run.tensorboard) if self.is_main else None
        if self.is_main:
            save_config(cfg, self.run_dir / "config.toml")
        self.profiler = StepProfiler(cfg.profile, self.run_dir, self.topology.rank, self.device)
        self.start_step, self.val_start, self.interval, self.comm_mark = 0, None, Interval(), self.ledger.stats()
        self.resumed: dict = {"resumed_from_step": None, "steps_lost": 0, "restart_count": resume.restart_count()}
        found = resume.find_resume(cfg.checkpoint.resume, self.checkpoint_folder)
        if found is not None:
            self._resume(found)

    @functools.cached_property
    def model_flops(self) -> ModelFlops:
        """flops_per_s and mfu of a metrics line (rank 0 only: no collective)."""
        return ModelFlops(self.cfg, self.device, self.topology.world_size)

    @functools.cached_property
    def timer(self) -> StepTimer:
        """Each step's time split (``train.time_breakdown``; a no-op when off)."""
        return StepTimer(self.device, self.ledger, self.cfg.train.time_breakdown)

    @functools.cached_property
    def lora_record(self) -> dict | None:
        """What a checkpoint's adapters are relative to (``tessera.lora.record``): computed once, not per save
        (a ``model.hf`` base is a digest of its files)."""
        return adapter_record(self.cfg)

    @property
    def checkpoint_folder(self) -> Path:
        return self.run_dir / self.cfg.checkpoint.folder

    def _resume(self, path: Path) -> None:
        """Continue from checkpoint ``path``: tensors (resharded if the layout changed), data position,
        learning-rate schedule, loss scale, the metrics interval in progress and, at the same world size,
        every rank's random generators — so the run goes on as if it had never stopped."""
        meta = load_training_state(path, self.core, self.optimizer, self.engine, self.topology)
        step = int(meta["step"])
        self.start_step, self.val_start = step, meta.get("val_loss_start")
        self.interval = Interval(**meta.get("interval", {}))
        self.sampler.load_state_dict(meta["sampler"])
        for key, value in meta.get("loss_scaler", {}).items():
            setattr(self.scaler, key, value)
        resume.set_scheduler_step(self.scheduler, self.optimizer,
                                  step - (self.scaler.skipped if self.skips_hold_lr else 0))
        if meta.get("world_size") == self.topology.world_size:
            resume.restore_rng_state(meta.get("rng"), self.topology.rank, self.device)
        reached = resume.read_progress(self.run_dir) if self.cfg.checkpoint.resume == "auto" else None
        self.resumed.update(resumed_from_step=step, resumed_from=str(path),
                            steps_lost=max(0, (reached or step) - step))
        if self.metrics and self.cfg.checkpoint.resume == "auto":
            self.metrics.truncate_after(step)  # the failed attempt's lines after the checkpoint are redone
        if self.is_main:
            tqdm.write(f"resuming from {path} at step {step}"
                       + (f" ({self.resumed['steps_lost']} steps after it are repeated)"
                          if self.resumed["steps_lost"] else ""), file=sys.stderr)

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg.train
        start = time.perf_counter()
        resumed = self.start_step and self.val_start is not None
        val_start = self.val_start if resumed else self._validate(self.start_step)
        self.comm_mark = self.ledger.stats()  # the first validation's all-reduces are not the interval's
        bar = tqdm(total=cfg.steps, initial=self.start_step, desc="train", unit="step",
                   disable=not (self.is_main and self.cfg.run.progress), dynamic_ncols=True)
        val_end, last_loss = val_start, float("nan")
        for step in range(self.start_step + 1, cfg.steps + 1):
            result, seconds = self.step_once(step)
            last_loss = result.loss
            bar.update(1)
            bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{result.tokens / seconds:,.0f}")
            if step % cfg.eval_every == 0 or step == cfg.steps:
                val_end = self._validate(step)
            if self.is_main:
                resume.write_progress(self.run_dir, step)
            if self.cfg.checkpoint.every and step % self.cfg.checkpoint.every == 0 and step < cfg.steps:
                self._save_checkpoint(step, self.interval, val_start)
        bar.close()
        checkpoint = (self._save_checkpoint(cfg.steps, Interval(), val_start)
                      if self.cfg.checkpoint.save_final else None)
        self.timeline = self.pipe.write_timeline(self.run_dir) if self.pipe and self.cfg.pipeline.timeline else {}
        return self._finish(val_start, val_end, last_loss, time.perf_counter() - start, checkpoint)

    def step_once(self, step: int):
        """Step ``step`` of ``fit``'s loop less validation, progress and checkpoints: the (profiled) step, the
        metrics interval (``self.interval``, ``self.comm_mark``) and its line when due. (StepResult, seconds)."""
        log_now = step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps
        with self.profiler.step(step):  # a chosen step's trace is written after it, outside its timer
            result, grad_norm, seconds = self._train_step(
                track=log_now, drain=self.pipe is None or self.pipe.drains_after(step, self.cfg))
        add_split((interval := self.interval).time_split, self.timer.take())
        if grad_norm is None:
            self._log_skip(step, interval)
        interval.steps += 1
        interval.loss += result.loss
        interval.tokens += result.tokens
        interval.seconds += seconds
        interval.grad_norm = grad_norm if grad_norm is not None else interval.grad_norm
        if log_now:
            self._log_train(step, interval, self.ledger.since(self.comm_mark))
            self.interval, self.comm_mark = Interval(), self.ledger.stats()
        return result, seconds

    def _train_step(self, track: bool, drain: bool = True):
        """One optimizer step; when ``track``, also measure saved activations and take a memory snapshot
        after the update, while gradients (and communication buckets) are still held. ``drain``: a
        pipeline without a flush empties after this step (else it takes the next step's batches now)."""
        synchronize(self.device)
        t0 = time.perf_counter()
        self.timer.start()
        def fetch():  # the sampler's next step, sharded (a pipeline without a flush fetches one step ahead)
            return shard_step(self.sampler.next_batches(self.corpus.train), self.topology, self.core)
        s = self.sampler  # (seed, the run's sample index of this rank's first row): keys the MoE routers' noise
        early = self.pipe is not None and self.pipe.lookahead.holds_next  # this step's batches came a step ago
        rows = (self.cfg.run.seed, s.samples_consumed - early * s.global_batch_size
                + s.dp_rank * (s.global_batch_size // s.dp_size))
        batches = fetch() if self.pipe is None else self.pipe.take_batches(fetch, drain)
        tracker = self.memory.track_activations if track else None
        if self.pipe is not None:  # a schedule interleaves forwards and backwards: timed together
            with self.timer.phase("forward_backward"):
                result = self.pipe.forward_backward(batches, activation_tracker=tracker, loss_scale=self.scaler.scale,
                                                    rows=(*rows, s.global_batch_size) if self.cfg.model.num_experts
                                                    else None)
        else:
            step_group = (self.mode and self.mode.step_group) or self.tokens_group  # async ps: this rank alone
            result = forward_backward(self.model, batches, step_group, self.device, activation_tracker=tracker,
                                      loss_scale=self.scaler.scale, loss_fn=self.loss_fn, timer=self.timer,
                                      rows=rows if self.cfg.model.num_experts else None)
        with self.timer.phase("optimizer"):
            grad_norm = self.update()
            if grad_norm is not None or not self.skips_hold_lr:  # DeepSpeed's schedules wait out a skipped step
                self.scheduler.step()
        if track:
            self.last_memory = self.memory.snapshot(peak_memory_bytes(self.device))
        self.update.zero_grad()
        synchronize(self.device)
        return result, grad_norm, time.perf_counter() - t0

    def _log_skip(self, step: int, interval: Interval) -> None:
        """A skipped step is never silent: a line on rank 0 now, and ``skipped_at`` / ``skipped_steps``
        in the next metrics.jsonl train record."""
        interval.skipped_at.append(step)
        if self.is_main:
            tqdm.write(f"step {step}: inf/nan gradients, optimizer step skipped; "
                       f"loss scale now {self.scaler.scale:g}", file=sys.stderr)

    # ---- reporting -----------------------------------------------------------------------------
    def _validate(self, step: int) -> float:
        if self.mode is not None:
            self.mode.before_eval()
        if self.pipe is not None:
            loss = self.pipe.evaluate(self.eval_batches)
        else:
            loss = evaluate(self.model, self.eval_batches, self.tokens_group, self.device, loss_fn=self.loss_fn)
        if self.metrics:
            self.metrics.log({"kind": "eval", "step": step, "val_loss": finite(loss)})
        return loss

    def _memory_per_rank(self) -> list[dict]:
        """Every rank's MemorySnapshot, gathered on rank 0 (a collective: all ranks call it)."""
        values = self.last_memory.as_dict()
        keys = list(values)
        local = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=self.device)
        gathered = comm.gather(local, self.world, dst=0)
        if gathered is None:
            return []
        return [{"rank": r, **{k: int(v) for k, v in zip(keys, t.tolist())}} for r, t in enumerate(gathered)]

    def _log_train(self, step: int, interval: Interval, comm_stats) -> None:
        memory = self._memory_per_rank()
        moe = {}
        if self.cfg.model.num_experts:
            from tessera.moe import moe_metrics

            # collective (pp, dp × cp): every stage's routing counters since the last log
            moe = moe_metrics(self.core, [self.topology.group("pp"), self.tokens_group], self.cfg.model)
        padding = self.sampler.take_padding()  # padded target positions ÷ all, every rank's step counted
        if not self.metrics:
            return
        per_step = {key: {field: value / interval.steps for field, value in stat.items()}
                    for key, stat in CommLedger.as_dict(comm_stats).items()}
        self.metrics.log({
            "kind": "train", "step": step, "loss": finite(interval.loss / interval.steps),
            "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": interval.tokens / interval.seconds,
            **self.model_flops.fields(interval.tokens / interval.seconds),
            "grad_norm": finite(interval.grad_norm), "comm_per_step": per_step, "memory": memory,
            "loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped,
            "skipped_at": interval.skipped_at, "padding_fraction": padding, **moe,
            **split_fields(interval.time_split, interval.steps),
            **self._mode_stats(),  # async parameter server: staleness so far
        })

    def _save_checkpoint(self, step: int, interval: Interval, val_start: float) -> str | None:
        """Every rank writes its part of ``step_<n>``; rank 0 then drops the oldest periodic ones."""
        rng = resume.gather_rng_states(self.world, self.device)  # collective
        meta = {"step": step, "sampler": self.sampler.state_dict(), "world_size": self.topology.world_size,
                "layout": self.topology.describe(), "loss_scaler": self.scaler.state_dict(),
                "interval": dataclasses.asdict(interval), "val_loss_start": val_start, "rng": rng,
                "lora": self.lora_record}
        path = step_path(self.checkpoint_folder, step)
        save_training_state(path, meta, self.core, self.optimizer, self.engine, self.topology)
        if self.is_main:
            prune(self.checkpoint_folder, self.cfg.checkpoint.keep)
        return str(path)

    def _finish(self, val_start: float, val_end: float, last_loss: float, seconds: float,
                checkpoint: str | None) -> dict:
        train_lines = self.metrics.train if self.metrics else []
        summary = {
            "run_dir": str(self.run_dir), "layout": self.topology.describe(),
            "world_size": self.topology.world_size, "preset": self.cfg.model_preset,
            "parameters": self.n_params, "trainable_parameters": self.n_trainable,
            "steps": self.cfg.train.steps, "val_loss_start": finite(val_start), "val_loss_end": finite(val_end),
            "train_loss_end": finite(last_loss), "seconds": seconds,
            "tokens_per_s_mean": (sum(r["tokens_per_s"] for r in train_lines) / len(train_lines)
                                  if train_lines else None),
            "comm_total": CommLedger.as_dict(self.ledger.stats()), "checkpoint": checkpoint,
            "memory_per_rank": train_lines[-1]["memory"] if train_lines else None,
            "skipped_steps": self.scaler.skipped, **self.timeline, **self.resumed, **self._mode_stats(),
        }
        if self.metrics:
            self.metrics.write_summary(summary)
            self.metrics.plot_loss(f"{self.cfg.model_preset} · {self.topology.describe()}")
            self.metrics.close()
        return summary

    def _mode_stats(self) -> dict:
        return self.mode.stats() if self.mode is not None else {}

    def close(self) -> None:
        if self.mode is not None:
            self.mode.close()
        self.topology.destroy()

