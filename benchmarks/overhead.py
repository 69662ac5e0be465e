"""tessera's single-process training step against a plain, nanoGPT-style PyTorch loop: step time.

One process, one model (the ``small`` preset), one batch, one optimizer. Variant A is tessera: a
``Trainer`` built by the code ``tessera train --nproc 1`` runs, stepped the way ``Trainer.fit`` steps it
(data from the default corpus through the window sampler, forward, token-weighted loss, backward,
job-wide clipping at 1.0, AdamW, learning-rate schedule, the metrics interval, a metrics line every
``train.log_every`` steps with its memory snapshot, the progress file) — everything but validation,
checkpoints and the progress bar. Variant B is the loop one writes by hand: the same windows sliced out
of the same token array, ``F.cross_entropy``, ``clip_grad_norm_``, ``torch.optim.AdamW`` with nanoGPT's
decay groups (matrices decayed, the rest not) and ``LambdaLR`` of the same warm-up + cosine. B starts from
A's initial weights (a copy of its state_dict), so both compute the same loss at step 1 and, after the
same update, at step 2: the script checks both before timing.

A and B alternate step by step in the same process (A B, B A, A B, …; ``--rounds`` rounds, each
``--warmup`` untimed then ``--steps`` timed steps of each) with a fixed number of torch threads, so the two
steps of a pair run within a second of each other. A round's step time is its mean (total ÷ steps), so the
steps that write a metrics line are counted; the ratio
reported is the median over rounds of (A's mean step ÷ B's mean step), with its range, of wall-clock time and
of CPU time.

    python benchmarks/overhead.py                          # 7 rounds, writes docs/BENCHMARKS.md
    python benchmarks/overhead.py --rounds 1 --steps 1 --no-write
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (DOCS, one_process_args, one_process_parser, provenance, replace_section, round_order,  # noqa: E402
                     spread)

from tessera.device import synchronize  # noqa: E402
from tessera.models import Transformer  # noqa: E402
from tessera.train import resume  # noqa: E402
from tessera.train.config import load_config  # noqa: E402
from tessera.train.data import WindowSampler  # noqa: E402
from tessera.train.optim import lr_factor  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"
TOTAL_STEPS = 10_000  # the schedule's length: long enough that no run reaches its end


class TesseraLoop:
    """One iteration of ``Trainer.fit``'s loop per call, minus validation, checkpoints and the progress
    bar: ``Trainer.step_once`` (the step, the interval's bookkeeping, a metrics line every
    ``train.log_every`` steps), then the progress file as ``fit`` writes it. Returns (seconds, loss)."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.step = trainer, 0

    def __call__(self) -> tuple[float, float]:
        tr = self.trainer
        synchronize(tr.device)
        t0 = time.perf_counter()
        self.step += 1
        result, _ = tr.step_once(self.step)
        resume.write_progress(tr.run_dir, self.step)
        synchronize(tr.device)
        return time.perf_counter() - t0, result.loss


class PlainLoop:
    """nanoGPT's training loop over the same model, windows, optimizer arguments and schedule.
    Returns (seconds, loss tensor) per call; the loss is read only when checked."""

    def __init__(self, trainer: Trainer):
        cfg, o, d = trainer.cfg, trainer.cfg.optim, trainer.cfg.data
        self.device, self.seq = trainer.device, d.seq_len
        self.data = trainer.corpus.train  # the token array (uint8 bytes), memory-mapped
        self.sampler = WindowSampler(self.data, d.seq_len, d.global_batch_size, d.micro_batch_size, 0, 1, d.seed)
        self.model = Transformer(cfg.model, cfg.moe, seed=cfg.run.seed).to(self.device)  # buffers: RoPE tables
        self.model.load_state_dict(trainer.core.state_dict())  # A's initial weights
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        impl = {k: v for k, v in trainer.optimizer.defaults.items() if k in ("foreach", "fused") and v is not None}
        self.opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **impl)  # A's kernel
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, o, TOTAL_STEPS))
        self.clip = o.grad_clip

    def get_batch(self, window_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """x_BS, y_BS: nanoGPT's slices of seq + 1 tokens, stacked."""
        rows = [torch.from_numpy(self.data[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
                for i in window_ids]
        xy = torch.stack(rows).to(self.device)
        return xy[:, :-1], xy[:, 1:]

    def __call__(self) -> tuple[float, torch.Tensor]:
        synchronize(self.device)
        t0 = time.perf_counter()
        micro = self.sampler.next_step()
        total = torch.zeros((), device=self.device)
        for ids in micro:  # gradient accumulation: each micro-batch's mean loss ÷ their number
            x, y = self.get_batch(ids)
            logits = self.model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / len(micro)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        synchronize(self.device)
        return time.perf_counter() - t0, total


def build(args, out_dir: str) -> tuple[TesseraLoop, PlainLoop]:
    cfg = load_config(None, [
        "--run.nproc=1", f"--run.device={args.device}", f"--model.preset={args.preset}",
        f"--data.seq_len={args.seq}", f"--data.global_batch_size={args.batch}",
        f"--data.micro_batch_size={args.micro_batch}", f"--train.steps={TOTAL_STEPS}",
        f"--run.out_dir={out_dir}", "--run.name=overhead", "--run.progress=false"])
    trainer = Trainer(cfg, torch.device(args.device))
    return TesseraLoop(trainer), PlainLoop(trainer)  # B copies A's weights before either has stepped


def check_same_losses(a: TesseraLoop, b: PlainLoop, steps: int = 2) -> list[tuple[float, float]]:
    """Both loops' losses at steps 1..``steps``; they must agree (same weights, data and update)."""
    pairs = [(a()[1], float(b()[1])) for _ in range(steps)]
    for i, (x, y) in enumerate(pairs, 1):
        if not abs(x - y) <= 1e-5 * abs(y):  # nan fails too
            raise SystemExit(f"step {i}: tessera loss {x:.7f} differs from the plain loop's {y:.7f}")
    return pairs


def timed(loop) -> tuple[float, float]:
    """One step's (wall seconds, this process's CPU seconds): on a shared machine the CPU time leaves
    out the time the process waited for a core."""
    c0 = time.process_time()
    wall = loop()[0]
    return wall, time.process_time() - c0


def measure(args) -> dict:
    """{"tessera": [(wall, cpu) mean s per step, per round], "plain": [...], "losses": [(A, B) at steps 1, 2]}.
    A mean, not a median: the one step in ``train.log_every`` that writes a metrics line is part of the cost."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out_dir:
        a, b = build(args, out_dir)
        losses = check_same_losses(a, b)
        med = {"tessera": [], "plain": []}
        loops = {"tessera": a, "plain": b}
        for r in range(args.rounds):
            for i in range(args.warmup):
                for name in round_order(loops, r + i):
                    loops[name]()
            got = {name: [] for name in loops}
            for i in range(args.steps):  # step by step: A B, B A, …
                for name in round_order(loops, r + args.warmup + i):
                    got[name].append(timed(loops[name]))
            for name, pairs in got.items():
                walls, cpus = zip(*pairs)
                med[name].append((statistics.fmean(walls), statistics.fmean(cpus)))
        a.trainer.metrics.close()
        a.trainer.close()
    return {**med, "losses": losses, "log_every": a.trainer.cfg.train.log_every}


def report(args, res: dict) -> list[str]:
    wall = [x[0] / y[0] for x, y in zip(res["tessera"], res["plain"])]
    cpu = [x[1] / y[1] for x, y in zip(res["tessera"], res["plain"])]
    (a1, b1), (a2, b2) = res["losses"]
    return [
        f"Model: `{args.preset}` preset, fp32, one process on `{args.device}` with "
        f"`torch.set_num_threads({args.threads})`; a step is {args.batch}×{args.seq} tokens in micro-batches "
        f"of {args.micro_batch}, AdamW (lr, betas, eps, decay groups and warm-up + cosine schedule as "
        "`[optim]`), clipping at 1.0. tessera = a `Trainer` as tessera train with one rank builds it, stepped "
        "by `Trainer.step_once`, the body of `Trainer.fit`'s loop (sampler, token-weighted loss, job-wide "
        "clipping, schedule, a metrics line with its memory snapshot every "
        f"{res['log_every']} steps), plus the progress file, without validation, checkpoints or the progress "
        "bar; plain = a nanoGPT-style loop of the same model started from tessera's initial weights, on the "
        "same windows. Same process, alternating step by step (A B, B A, A B, …): "
        f"{args.rounds} rounds of {args.warmup} warm-up + "
        f"{args.steps} timed steps of each; a round's step time is its mean (total ÷ steps, so the logged steps "
        "count); ratio = per-round (tessera mean ÷ plain mean), median (min–max), of wall-clock time (the "
        "target: ≤ 1.03) and of the process's CPU time (which leaves out waiting for a core on a shared "
        "machine).",
        "",
        "| tessera step (median of round means) | plain step | tessera ÷ plain, wall "
        "| tessera ÷ plain, CPU time | loss at step 1 (tessera / plain) | at step 2 |",
        "|---|---|---|---|---|---|",
        f"| {statistics.median(x[0] for x in res['tessera']) * 1e3:.1f} ms "
        f"| {statistics.median(x[0] for x in res['plain']) * 1e3:.1f} ms | {spread(wall)} | {spread(cpu)} "
        f"| {a1:.6f} / {b1:.6f} | {a2:.6f} / {b2:.6f} |",
        "",
        provenance(),
    ]


def main() -> None:
    parser = one_process_parser(__doc__, "torch.set_num_threads for both loops")
    args = one_process_args(parser)
    lines = report(args, measure(args))
    print("\n".join(lines))
    if not args.no_write:
        replace_section(DOC, "overhead", "Single-process overhead: tessera vs a plain PyTorch loop", lines)


if __name__ == "__main__":
    main()
