"""``[kernels]`` choices against the defaults on this machine: step time of one process, each setting alone.

One process, the ``small`` preset, one batch size: one ``Trainer`` per variant (as ``tessera train --nproc 1``
builds it, with that variant's ``--kernels.*`` keys), each stepped the way ``Trainer.fit`` steps it (forward,
token-weighted loss, backward, clipping, AdamW, schedule) without metrics lines, validation or checkpoints.
Every trainer starts from the same weights (``run.seed``) on the same windows; before timing, each variant's
first-step loss must equal the default's (rel 1e-5: the same mathematics, rounded differently).

The variants alternate in the same process (default, then each variant, per round: ``--rounds`` rounds, each
``--warmup`` untimed then ``--steps`` timed steps) with a fixed number of torch threads. Reported per variant:
the median over rounds of (variant's median step ÷ the default's median step of the same round), with its
range. ``compile`` (``kernels.compile = true``, inductor) compiles in the first step of every variant, the
untimed one whose loss is checked before any round; that first step's time is reported separately.

    python benchmarks/kernel_settings.py                  # 7 rounds, writes docs/BENCHMARKS.md
    python benchmarks/kernel_settings.py --rounds 1 --steps 1 --no-write
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, one_process_args, one_process_parser, provenance, replace_section, spread  # noqa: E402

from tessera.device import synchronize  # noqa: E402
from tessera.train.config import load_config, validate_config  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"
TOTAL_STEPS = 10_000  # the schedule's length: long enough that no run reaches its end
VARIANTS = {  # name → the keys it sets; "default" is every key at its default
    "default": [],
    "adamw=foreach": ["--kernels.adamw=foreach"],
    "adamw=fused": ["--kernels.adamw=fused"],
    "rms_norm=torch": ["--kernels.rms_norm=torch"],
    "gqa=sdpa": ["--kernels.gqa=sdpa"],
    "all three": ["--kernels.adamw=fused", "--kernels.rms_norm=torch", "--kernels.gqa=sdpa"],
    "compile": ["--kernels.compile=true"],
}


class Stepper:
    """One training step of ``trainer`` per call; returns (seconds, loss)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def __call__(self) -> tuple[float, float]:
        tr = self.trainer
        synchronize(tr.device)
        t0 = time.perf_counter()
        result, _, _ = tr._train_step(track=False)
        synchronize(tr.device)
        return time.perf_counter() - t0, result.loss


def build(args, name: str, out_dir: str) -> Stepper:
    cfg = load_config(None, [
        "--run.nproc=1", f"--run.device={args.device}", f"--model.preset={args.preset}",
        f"--data.seq_len={args.seq}", f"--data.global_batch_size={args.batch}",
        f"--data.micro_batch_size={args.micro_batch}", f"--train.steps={TOTAL_STEPS}",
        f"--run.out_dir={out_dir}", f"--run.name={name.replace('=', '-').replace(' ', '-')}",
        "--run.progress=false", *VARIANTS[name]])
    validate_config(cfg, 1)
    return Stepper(Trainer(cfg, torch.device(args.device)))


def measure(args, names: list[str]) -> dict:
    """{"times": {name: [median step s per round]}, "loss1": {name: first-step loss}, "first_call": {...}}."""
    with tempfile.TemporaryDirectory() as out_dir:
        steppers = {name: build(args, name, out_dir) for name in names}
        first = {name: stepper() for name, stepper in steppers.items()}  # compile traces here
        want = first["default"][1]
        for name, (_, loss) in first.items():
            if not abs(loss - want) <= 1e-5 * abs(want):  # nan fails too
                raise SystemExit(f"{name}: first-step loss {loss:.7f} differs from the default's {want:.7f}")
        times = {name: [] for name in names}
        for _ in range(args.rounds):
            for name, stepper in steppers.items():
                for _ in range(args.warmup):
                    stepper()
                times[name].append(statistics.median(stepper()[0] for _ in range(args.steps)))
        for stepper in steppers.values():
            if stepper.trainer.metrics is not None:
                stepper.trainer.metrics.close()
            stepper.trainer.close()
    return {"times": times, "loss1": {n: v[1] for n, v in first.items()},
            "first_call": {n: v[0] for n, v in first.items()}}


def report(args, res: dict) -> list[str]:
    base = res["times"]["default"]
    lines = [
        f"Model: `{args.preset}` preset, fp32, one process on `{args.device}` with "
        f"`torch.set_num_threads({args.threads})`; a step is {args.batch}×{args.seq} tokens in micro-batches "
        f"of {args.micro_batch}: forward, token-weighted loss, backward, clipping at 1.0, AdamW, schedule "
        "(a `Trainer` as `tessera train --nproc 1` builds it, stepped as `Trainer.fit` steps it, without "
        "metrics lines, validation or checkpoints). One trainer per variant, all from the same initial "
        "weights (first-step losses equal within rel 1e-5, checked), interleaved in one process: "
        f"{args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed steps per variant; ratio = per "
        "round (variant median ÷ default median), median (min–max); below 1.00 the variant is faster. A "
        "CPU build: fused kernels and compiled blocks pay off mostly on a GPU, where these keys are meant "
        "to be measured again.",
        "",
        "| variant | keys | step | ÷ default | first step (incl. compilation) |",
        "|---|---|---|---|---|",
    ]
    for name, per_round in res["times"].items():
        keys = ", ".join(f"`{k.removeprefix('--')}`" for k in VARIANTS[name]) or "—"
        ratio = "1" if name == "default" else spread([v / b for v, b in zip(per_round, base)])
        lines.append(f"| {name} | {keys} | {statistics.median(per_round) * 1e3:.1f} ms | {ratio} "
                     f"| {res['first_call'][name]:.2f} s |")
    return [*lines, "", provenance()]


def main() -> None:
    parser = one_process_parser(__doc__, "torch.set_num_threads for every variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="which to run (the default always runs: the ratios are against it)")
    args = one_process_args(parser)
    names = ["default", *(n for n in args.variants if n != "default")]
    lines = report(args, measure(args, names))
    print("\n".join(lines))
    if not args.no_write:
        replace_section(DOC, "kernels", "Kernel settings on this CPU", lines)


if __name__ == "__main__":
    main()
