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

import torch

from tessera.device import computes_on_cpu
from tessera.planner.calibrate import matmul_flops

SLOW_RATIO = 3.0  # a half-precision product this many times slower than fp32's is worth a warning
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def half_matmul_slowdown(dtype: torch.dtype, n: int = 256, seconds: float = 0.05) -> float:
    """Seconds of an n×n @ n×n product in ``dtype`` over fp32's on this CPU, each timed for ``seconds`` on one
    thread by the planner's calibration (the kernels' own speed, without the thread start-up and sharing that
    blur products this small)."""
    return matmul_flops(n, seconds, threads=1) / matmul_flops(n, seconds, threads=1, dtype=dtype)


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels use here ("AVX2", "AVX512", ...), or "unknown"."""
    return getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()


def slow_half_precision_note(device: str, dtype: str) -> str | None:
    """A one-line warning when the job computes in ``dtype`` ("bf16"/"fp16") on a CPU whose products in it
    are at least SLOW_RATIO times slower than fp32's; None for fp32, accelerators and fast CPUs."""
    if dtype not in _DTYPES or not computes_on_cpu(device):
        return None
    slowdown = half_matmul_slowdown(_DTYPES[dtype])
    if slowdown < SLOW_RATIO:
        return None
    capability = cpu_capability()
    return (f"tessera: warning: a {dtype} matrix product takes {slowdown:.0f}× as long as an fp32 one on this CPU "
            f"({capability}: torch's reference kernel, without {dtype} instructions), so this job may train "
            "several times slower than with --precision.dtype=fp32")
