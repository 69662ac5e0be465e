"""Whether this CPU multiplies half-precision matrices fast: measured before launch, not guessed from flags.

torch runs bf16 and fp16 matrix products on a CPU through oneDNN only when the CPU has instructions for them
(AVX512 or AMX for bf16; AVX512-FP16, AMX-FP16 or AVX-NE-CONVERT for fp16). Elsewhere it takes its reference
kernel: on an AVX2-only host a 1024² bf16 product runs at 0.9 GFLOP/s against 77 for fp32
(``benchmarks/cpu_matmul.py``), so a bf16 job there trains many times slower than the same job in fp32, and
nothing else would say so before the first step. ``tessera train`` times one small product in fp32 and one in
the job's dtype (about a tenth of a second, on one thread) and warns when the latter is at least
:data:`SLOW_RATIO` times slower.
"""

from __future__ import annotations

import time

import torch

from tessera.device import computes_on_cpu

SLOW_RATIO = 3.0  # a half-precision product this many times slower than fp32's is worth a warning
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _best_seconds(a: torch.Tensor, b: torch.Tensor, repeats: int = 3) -> float:
    a @ b  # the first call may set kernels up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


def half_matmul_slowdown(dtype: torch.dtype, n: int = 256) -> float:
    """Seconds of an n×n @ n×n product in ``dtype`` over fp32's on this CPU (the best of 3 of each), on one
    thread: the kernels' own speed, without the thread start-up and sharing that blur products this small."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = _best_seconds(a, b)
        return _best_seconds(a.to(dtype), b.to(dtype)) / max(fp32, 1e-9)
    finally:
        torch.set_num_threads(threads)


def slow_half_precision_note(device: str, dtype: str) -> str | None:
    """A one-line warning when the job computes in ``dtype`` ("bf16"/"fp16") on a CPU whose products in it
    are at least SLOW_RATIO times slower than fp32's; None for fp32, accelerators and fast CPUs."""
    if dtype not in _DTYPES or not computes_on_cpu(device):
        return None
    slowdown = half_matmul_slowdown(_DTYPES[dtype])
    if slowdown < SLOW_RATIO:
        return None
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return (f"tessera: warning: a {dtype} matrix product takes {slowdown:.0f}× as long as an fp32 one on this CPU "
            f"({capability}: torch's reference kernel, without {dtype} instructions), so this job may train "
            "several times slower than with --precision.dtype=fp32")
