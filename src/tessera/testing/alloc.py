"""How many bytes of tensor memory a block of code allocates: the most live at once, and what is left.

Tests use it to prove that a rank never holds more than it owns (building a model costs its local
parameters plus a bounded init temporary)::

    with AllocationMeter() as meter:            # the CPU; AllocationMeter(device) for an accelerator
        model = build()
    assert meter.peak_bytes <= budget

On the CPU torch has no allocator hook, but its profiler with ``profile_memory=True`` sees every
allocation and free the CPU allocator makes for the torch calls of the thread that entered the meter
(factories, op outputs, temporaries inside ops), with the block's address and size; a thread of its own
(a Python thread, a communication backend's) is not seen. The meter runs that profiler over the block and
replays its allocation events in time order. It counts only blocks allocated inside the meter: freeing a
tensor that existed before does not lower the count (so ``peak_bytes``/``end_bytes`` are the memory the
block itself allocated, the same as "above what was live at entry" for code that frees nothing older).
Sizes are the bytes requested (``numel · element_size``, no allocator rounding). Memory not made by
torch's CPU allocator (numpy arrays, Python objects) is not seen. The profiler cannot run twice at once:
meters on the CPU do not nest, and none runs inside ``torch.profiler.profile``.

On an accelerator the caching allocator keeps exact counters (``torch.accelerator.memory_allocated`` and
``max_memory_allocated``, in its block sizes: multiples of 512 bytes on CUDA); the meter reads them at
entry and exit and resets the device's peak counter at entry.
"""

from __future__ import annotations

import torch
from torch._C._profiler import _EventType

__all__ = ["AllocationMeter"]


class AllocationMeter:
    """Context manager: after the block, ``peak_bytes`` is the largest number of bytes allocated inside it
    and live at the same moment, ``end_bytes`` those still live at exit (both ≥ 0), ``allocations`` how
    many allocations it saw (CPU only; None on an accelerator)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.end_bytes = 0
        self.allocations: int | None = None
        self._profiler = None
        self._start = 0

    def __enter__(self) -> AllocationMeter:
        if self.device.type == "cpu":
            if torch.autograd._profiler_enabled():  # a second profiler would silently end the first one
                raise RuntimeError("AllocationMeter on the CPU cannot run while a profiler (or another "
                                   "CPU AllocationMeter) is running")
            self._profiler = torch.autograd.profiler.profile(profile_memory=True)
            self._profiler.__enter__()
        else:
            torch.accelerator.synchronize(self.device)
            self._start = torch.accelerator.memory_allocated(self.device)
            torch.accelerator.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
            self.peak_bytes = max(0, torch.accelerator.max_memory_allocated(self.device) - self._start)
            self.end_bytes = max(0, torch.accelerator.memory_allocated(self.device) - self._start)
            return False
        self._profiler.__exit__(exc_type, exc, tb)
        events = _cpu_allocation_events(self._profiler.kineto_results)
        self._profiler = None
        self.allocations = sum(1 for _, _, size in events if size > 0)
        self.peak_bytes, self.end_bytes = _replay(events)
        return False


def _cpu_allocation_events(results) -> list[tuple[int, int, int]]:
    """The profile's CPU allocator events as (time ns, address, signed bytes), in time order."""
    events = []
    stack = list(reversed(results.experimental_event_tree()))
    while stack:
        e = stack.pop()
        stack.extend(reversed(e.children))  # keep tree order for events with equal times
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
    events.sort(key=lambda ev: ev[0])
    return events


def _replay(events: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(peak, end) bytes live of the blocks allocated within ``events``; frees of older blocks are ignored."""
    live: dict[int, int] = {}  # address -> bytes of a block allocated inside the meter
    now = peak = 0
    for _, ptr, size in events:
        if size > 0:
            live[ptr] = size
            now += size
            peak = max(peak, now)
        elif ptr in live:
            now -= live.pop(ptr)
    return peak, now
