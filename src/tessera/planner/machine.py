"""The memory this machine gives each local rank, and what a rank costs before it holds any model state.

A CPU rank's peak resident memory is the planner's prediction (model states, activations, buffers, and
the offloaded optimizer states, which live in the same RAM) plus :data:`PROCESS_BYTES`, the fixed cost
of a training process: Python, torch, gloo, the token cache and the allocator's slack around them.
Measured on this project's CPU machines with ``benchmarks/memory_check.py``: a rank of the tiny preset
(0.5 MB of model states, 1.6 MB of activations) peaks at 0.38 GB resident (rank 0, which also draws
the loss plot at the end; 0.35 GB at the trainer's last memory snapshot).

A machine's memory per local rank: on the CPU the RAM that is available now (``MemAvailable`` of
``/proc/meminfo``: free memory plus the caches the kernel can drop; elsewhere the total physical memory)
shared by the local ranks; on an accelerator each rank's own device. :data:`HEADROOM` of it is kept free
(allocator fragmentation, the launcher and the rest of the machine).
"""

from __future__ import annotations

import os
from pathlib import Path

PROCESS_BYTES = 0.38e9  # fixed resident memory of one CPU rank (measured: tiny preset, 2 ranks, 0.38 GB)
HEADROOM = 0.10  # fraction of the memory per rank left free
MEMINFO = Path("/proc/meminfo")


def host_memory_bytes() -> int:
    """Bytes of RAM available to new processes now: ``MemAvailable`` where the kernel reports it, else
    the total physical memory."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def usable_per_rank(memory_bytes: float) -> float:
    """Of ``memory_bytes`` per rank, what a rank's predicted peak may use (:data:`HEADROOM` kept free)."""
    return memory_bytes * (1.0 - HEADROOM)
