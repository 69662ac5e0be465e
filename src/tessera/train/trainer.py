"""The training loop of one rank: build everything from a JobConfig, train, validate, write the run.

Every rank runs this; collective calls happen in the same order on all of them. Only rank 0 writes
files (metrics, summary, plot), except the checkpoint, which every rank writes its part of.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tessera import comm
from tessera.comm.ledger import CommLedger
from tessera.device import peak_memory_bytes, synchronize
from tessera.models import Transformer
from tessera.parallelize import parallelize
from tessera.topology import Topology
from tessera.train.checkpoint import save_checkpoint
from tessera.train.config import JobConfig, save_config
from tessera.train.data import WindowSampler, eval_windows, load_corpus, make_batch
from tessera.train.memory import MemoryLedger
from tessera.train.metrics import MetricsWriter, finite
from tessera.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from tessera.train.rundir import resolve_run_dir
from tessera.train.step import evaluate, forward_backward


@dataclass
class Interval:
    """What happened since the last metrics line."""

    steps: int = 0
    loss: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    grad_norm: float = 0.0


class Trainer:
    def __init__(self, cfg: JobConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.ledger = CommLedger()
        self.topology = Topology.build(cfg.parallel, self.ledger)
        self.world = self.topology.group("world")
        self.dp = self.topology.group("dp")
        self.is_main = self.topology.rank == 0
        torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank (DDP also broadcasts)
        self.core = Transformer(cfg.model).to(device)
        self.model = parallelize(self.core, self.topology, cfg.ddp)
        self.optimizer = build_optimizer(self.core, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.memory = MemoryLedger(self.core, self.optimizer,
                                   grad_buffers=getattr(self.model, "grad_buffers", ()))
        self.last_memory = None
        self.corpus = load_corpus(cfg.data, progress=self.is_main and cfg.run.progress)
        d = cfg.data
        self.sampler = WindowSampler(len(self.corpus.train), d.seq_len, d.global_batch_size, d.micro_batch_size,
                                     self.dp.rank, self.dp.size, d.seed)
        self.eval_batches = [
            [make_batch(self.corpus.val, ids, d.seq_len) for ids in micro]
            for micro in eval_windows(len(self.corpus.val), d.seq_len, d.global_batch_size, d.eval_batches,
                                      d.micro_batch_size, self.dp.rank, self.dp.size)
        ]
        self.run_dir = resolve_run_dir(cfg, self.topology, device)
        self.metrics = MetricsWriter(self.run_dir) if self.is_main else None
        if self.is_main:
            save_config(cfg, self.run_dir / "config.toml")

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg.train
        start = time.perf_counter()
        val_start = self._validate(0)
        interval, comm_mark = Interval(), self.ledger.stats()
        bar = tqdm(total=cfg.steps, desc="train", unit="step", disable=not (self.is_main and self.cfg.run.progress),
                   dynamic_ncols=True)
        val_end, last_loss = val_start, float("nan")
        for step in range(1, cfg.steps + 1):
            log_now = step % cfg.log_every == 0 or step == cfg.steps
            result, grad_norm, seconds = self._train_step(track=log_now)
            interval.steps += 1
            interval.loss += result.loss
            interval.tokens += result.tokens
            interval.seconds += seconds
            interval.grad_norm = grad_norm
            last_loss = result.loss
            bar.update(1)
            bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{result.tokens / seconds:,.0f}")
            if log_now:
                self._log_train(step, interval, self.ledger.since(comm_mark))
                interval, comm_mark = Interval(), self.ledger.stats()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                val_end = self._validate(step)
        bar.close()
        checkpoint = self._save_checkpoint(cfg.steps)
        return self._finish(val_start, val_end, last_loss, time.perf_counter() - start, checkpoint)

    def _train_step(self, track: bool):
        """One optimizer step; when ``track``, also measure saved activations and take a memory snapshot
        after the update, while gradients (and communication buckets) are still held."""
        synchronize(self.device)
        t0 = time.perf_counter()
        batches = [make_batch(self.corpus.train, ids, self.cfg.data.seq_len) for ids in self.sampler.next_step()]
        result = forward_backward(self.model, batches, self.dp, self.device,
                                  activation_tracker=self.memory.track_activations if track else None)
        grad_norm = clip_grad_norm(self.core.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        if track:
            self.last_memory = self.memory.snapshot(peak_memory_bytes(self.device))
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        return result, grad_norm, time.perf_counter() - t0

    # ---- reporting -----------------------------------------------------------------------------
    def _validate(self, step: int) -> float:
        loss = evaluate(self.model, self.eval_batches, self.dp, self.device)
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
        if not self.metrics:
            return
        per_step = {key: {field: value / interval.steps for field, value in stat.items()}
                    for key, stat in CommLedger.as_dict(comm_stats).items()}
        self.metrics.log({
            "kind": "train", "step": step, "loss": finite(interval.loss / interval.steps),
            "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": interval.tokens / interval.seconds,
            "grad_norm": finite(interval.grad_norm), "comm_per_step": per_step, "memory": memory,
        })

    def _save_checkpoint(self, step: int) -> str | None:
        if not self.cfg.checkpoint.save_final:
            return None
        meta = {"step": step, "sampler": self.sampler.state_dict(), "world_size": self.topology.world_size}
        path = save_checkpoint(self.run_dir / self.cfg.checkpoint.folder, self.core, self.optimizer, meta,
                               self.world)
        return str(path)

    def _finish(self, val_start: float, val_end: float, last_loss: float, seconds: float,
                checkpoint: str | None) -> dict:
        train_lines = self.metrics.train if self.metrics else []
        summary = {
            "run_dir": str(self.run_dir), "layout": self.topology.describe(),
            "world_size": self.topology.world_size, "preset": self.cfg.model_preset,
            "parameters": sum(p.numel() for p in self.core.parameters()),
            "steps": self.cfg.train.steps, "val_loss_start": finite(val_start), "val_loss_end": finite(val_end),
            "train_loss_end": finite(last_loss), "seconds": seconds,
            "tokens_per_s_mean": (sum(r["tokens_per_s"] for r in train_lines) / len(train_lines)
                                  if train_lines else None),
            "comm_total": CommLedger.as_dict(self.ledger.stats()), "checkpoint": checkpoint,
            "memory_per_rank": train_lines[-1]["memory"] if train_lines else None,
        }
        if self.metrics:
            self.metrics.write_summary(summary)
            self.metrics.plot_loss(f"{self.cfg.model_preset} · {self.topology.describe()}")
            self.metrics.close()
        return summary

    def close(self) -> None:
        self.topology.destroy()

