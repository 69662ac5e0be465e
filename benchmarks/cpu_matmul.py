"""Matrix-product speed by dtype on this machine's CPU: why bf16 training is faster than fp32 on one host
and many times slower on another.

torch multiplies bf16 and fp16 matrices on the CPU through oneDNN only when the CPU has the instructions for
it (AVX512-BF16, AMX, AVX512 or AVX-NE-CONVERT); without them (an AVX2-only host) it takes its reference
kernel. This times ``a @ b`` for square matrices of a few sizes in fp32, bf16 and fp16, in one process with
a fixed number of threads, interleaved (each round times every dtype once), and reports GFLOP/s (2n³ per
product) as the median over rounds, with each dtype's time over fp32's.

    python benchmarks/cpu_matmul.py                    # writes docs/BENCHMARKS.md
    python benchmarks/cpu_matmul.py --sizes 256 --rounds 1 --no-write
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS, provenance, replace_section, spread  # noqa: E402

DOC = DOCS / "BENCHMARKS.md"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def product_seconds(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one n×n @ n×n product (one untimed product first)."""
    gen = torch.Generator().manual_seed(n)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="timed products per dtype and round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in args.sizes:
        per_round = {name: [] for name in DTYPES}
        for _ in range(args.rounds):
            for name, dtype in DTYPES.items():
                per_round[name].append(product_seconds(n, dtype, args.repeats))
        for name in DTYPES:
            secs = statistics.median(per_round[name])
            ratios = [t / f for t, f in zip(per_round[name], per_round["fp32"])]
            rows.append(f"| {n} | {name} | {secs * 1e3:.2f} | {2 * n**3 / secs / 1e9:.1f} | "
                        f"{spread(ratios, 2) if name != 'fp32' else '1'} |")
            print(rows[-1], flush=True)
    lines = [
        f"{provenance()} One process, {args.threads} thread(s); {args.rounds} interleaved rounds of "
        f"{args.repeats} timed products per dtype; time = median over rounds of a round's median product.",
        "",
        "| n | dtype | ms per n×n product | GFLOP/s | time ÷ fp32's, median (min–max) over rounds |",
        "|---|---|---|---|---|",
        *rows,
    ]
    if not args.no_write:
        replace_section(DOC, "cpu-matmul", "Matrix products by dtype on this CPU", lines)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
