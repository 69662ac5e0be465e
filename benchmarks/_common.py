"""Helpers shared by the benchmark scripts: the machine line, marked doc sections, common CLI and pools.

The scripts run as ``python benchmarks/x.py`` (this folder is then on sys.path); each also puts this folder
on sys.path itself before importing from here, so importing a script by another route works too.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"


def machine() -> str:
    """CPU model, core count, the instruction set torch's CPU kernels use, torch version and backend, as every
    benchmark table states them. The instruction set matters beside the model name: a host without AVX512
    multiplies bf16 matrices through torch's reference kernel, tens of times slower than fp32 (the VMs
    behind "AMD EPYC" are not all alike)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from tessera.precision.cpu_speed import cpu_capability

    return f"{cpu}, {os.cpu_count()} cores ({cpu_capability()}), torch {torch.__version__}, gloo"


def command_line() -> str:
    """How this script was run, as a doc line records it: ``python benchmarks/x.py --rounds 7``."""
    import shlex
    import sys

    return shlex.join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])


# The minimum number of interleaved rounds a published ratio rests on: fewer rounds on a shared machine
# give medians that move by more than the differences the tables report.
MIN_ROUNDS = 7
_LOAD_AT_IMPORT = os.getloadavg()[0]


def git_commit() -> str:
    """The checkout's commit (short hash), marked when tracked files other than documents differ from it, or
    "unknown"."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        # documents are what benchmarks write: a table measured after another one rewrote docs/ still ran
        # the committed code
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)docs", ":(exclude)*.md"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} with uncommitted changes" if dirty else head


def provenance() -> str:
    """What every benchmark table states about its numbers: the exact command, the commit, the machine and
    torch, and the machine's load when the script started and now (CPU timings are only as quiet as this).
    Call it at the end of the run."""
    cores = os.cpu_count()
    return (f"Command: `{command_line()}`; commit {git_commit()}; {machine()}; 1-minute load average "
            f"{_LOAD_AT_IMPORT:.1f} at the start and {os.getloadavg()[0]:.1f} at the end on {cores} cores.")


def spread(values: list[float], digits: int = 3) -> str:
    """A ratio as the tables report it: the median of per-round values with their range,
    ``0.953 (0.904–1.037)``."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def replace_section(path: Path, name: str, title: str, lines: list[str]) -> None:
    """Rewrite only the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` of a shared file (the
    rest stays as it is); a file without the markers gets the block appended under ``## title``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = "\n".join([begin, *lines, end])
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n## {title}\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def bench_parser(doc: str, *, ranks: list[int], preset: str, batch: int, seq: int, rounds: int, steps: int,
                 warmup: int, no_write_help: str | None = "print only; leave docs/BENCHMARKS.md alone"
                 ) -> argparse.ArgumentParser:
    """The options every timed A/B benchmark takes; the caller adds its own before ``parse_args``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=ranks)
    parser.add_argument("--preset", default=preset)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--no-write", action="store_true", help=no_write_help)
    return parser


@contextmanager
def pool_manager(pg_timeout_s: float = 600.0) -> Iterator:
    """A tessera PoolManager whose pools are closed on the way out."""
    from tessera.testing import PoolManager

    pools = PoolManager(pg_timeout_s=pg_timeout_s)
    try:
        yield pools
    finally:
        pools.close_all()


def token_batch(seed: int, batch: int, seq: int, vocab: int = 256):
    """A fixed random batch of token ids: (inputs, next-token targets), each ``batch`` × ``seq``."""
    data = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def round_order(names, i: int) -> list:
    """The variants' order in round ``i``: rotated by one each round (A B, B A, A B … for two). Whichever
    variant runs first meets a machine the previous one's threads and caches left in another state; a
    fixed order gave one variant that handicap every round (measured: it moved a single-process ratio by
    10%)."""
    names = list(names)
    return names[i % len(names):] + names[:i % len(names)]


def interleaved_times(steppers: dict, rounds: int, warmup: int, steps: int,
                      around: Callable[[object], ContextManager] | None = None) -> dict:
    """Time variants interleaved (A B, B A, A B …) so that a shared machine's noise hits them alike: every
    round, each variant in turn runs ``warmup`` untimed steps, a barrier over the default group, then
    ``steps`` timed ones, in :func:`round_order`. ``steppers[k]()`` runs one step and returns its seconds;
    ``around(k)``, if given, is entered around each variant's timed steps. Returns
    ``{k: [[seconds of each timed step] per round]}``."""
    import torch.distributed as dist

    times = {k: [] for k in steppers}
    for i in range(rounds):
        for k in round_order(steppers, i):
            step = steppers[k]
            for _ in range(warmup):
                step()
            dist.barrier()
            with around(k) if around is not None else nullcontext():
                times[k].append([step() for _ in range(steps)])
    return times


def slowest_medians(per_rank: list[list[list[float]]]) -> list[float]:
    """Per round, the slowest rank's median step (a job moves at the pace of its slowest rank).
    ``per_rank[r][i]`` is rank r's list of step times in round i."""
    return [max(statistics.median(rank[i]) for rank in per_rank) for i in range(len(per_rank[0]))]


def ab_summary(per_rank: list[dict], a: str, b: str) -> dict:
    """Two variants timed A B A B: per round, each one's slowest-rank median step and the ratio a / b.
    ``per_rank[r][a][i]`` is rank r's list of step times of variant a in round i."""
    med = {k: slowest_medians([t[k] for t in per_rank]) for k in (a, b)}
    return {**med, "ratio": [x / y for x, y in zip(med[a], med[b])]}


def no_forward_buffer_sync() -> dict:
    """torch DDP's switch for not syncing buffers every forward; torch renamed it and warns on the old name."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    params = inspect.signature(TorchDDP.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def one_process_parser(doc: str, threads_help: str) -> argparse.ArgumentParser:
    """The options of a benchmark that times variants in one process (small preset, 7 rounds of 2 warm-up
    + 10 timed steps, one thread unless told); ``--ranks`` is refused by ``one_process_args``."""
    parser = bench_parser(doc, ranks=[1], preset="small", batch=8, seq=128, rounds=MIN_ROUNDS, steps=10,
                          warmup=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help=threads_help)
    parser.add_argument("--device", default="cpu", help="cpu, or an accelerator such as cuda")
    return parser


def one_process_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, refuse --ranks other than 1 (exit 2), and fix torch's thread count as asked."""
    args = parser.parse_args()
    if args.ranks != [1]:
        parser.error("this benchmark runs in one process: --ranks must be 1")
    torch.set_num_threads(args.threads)
    return args
