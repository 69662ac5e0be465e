"""Watching the rank processes of a ``tessera train`` subprocess from outside, through ``/proc`` (Linux):
who they are, the kernel's high-water mark of each one's resident set (exact however short the peak) and
its storage I/O."""

from __future__ import annotations

from pathlib import Path


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (from each process's PPid in /proc)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            ppid = next((line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "0")
            parent[int(entry.name)] = int(ppid)
    below, frontier = [], [root]
    while frontier:
        kids = [pid for pid, pp in parent.items() if pp in frontier]
        below += kids
        frontier = kids
    return below


def is_rank(pid: int) -> bool:
    """A rank is a process the elastic agent started with multiprocessing's spawn (not its resource
    tracker); its RANK is set inside it after start, so /proc cannot tell which rank it is."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"spawn_main" in cmd and b"resource_tracker" not in cmd


def sample(pid: int) -> dict | None:
    """{"hwm", "read", "write"}: peak resident bytes (VmHWM) and bytes really read from / written to storage
    (page-cache hits excluded) of a live process, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except OSError:
        return None
    hwm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    return {"hwm": hwm, "read": int(io["read_bytes"]), "write": int(io["write_bytes"])}
