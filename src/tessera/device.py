"""Device helpers: the one place that knows about accelerators, so library code stays device-agnostic
(the same code runs on CPU/gloo and on GPU/NCCL)."""

from __future__ import annotations

import torch

from tessera.errors import ConfigError


def accelerator_type() -> str | None:
    """"cuda" (or another accelerator's name) when one is present, else None."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"auto"`` → the device this rank computes on."""
    if name == "cpu":
        return torch.device("cpu")
    kind = accelerator_type()
    if kind is None:
        if name == "auto":
            return torch.device("cpu")
        raise ConfigError(f"run.device is '{name}' but this machine has no accelerator; use run.device=cpu")
    return torch.device(kind, local_rank)


def computes_on_cpu(name: str) -> bool:
    """Whether ``run.device`` = ``name`` resolves to the CPU on this machine (``resolve_device``'s rule;
    a name that would fail there, e.g. "cuda" without an accelerator, is not the CPU)."""
    return name == "cpu" or (name == "auto" and accelerator_type() is None)


def visible_devices(device: torch.device) -> list[str]:
    """Every visible device of ``device``'s kind, by name: the CPU is one ("cpu"), an accelerator's kind
    lists each index ("cuda:0", "cuda:1", ...)."""
    if device.type == "cpu":
        return [str(device)]
    return [f"{device.type}:{i}" for i in range(torch.accelerator.device_count())]


def backend_for(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "nccl"


def comm_device(backend: str | None) -> torch.device:
    """Where the tensors handed to a process group of ``backend`` live: the CPU for gloo (and fake, mpi,
    or no process group), else this rank's current accelerator (NCCL and its kin)."""
    kind = accelerator_type()
    if backend is None or backend in ("gloo", "fake", "mpi") or kind is None:
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def set_device(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (a no-op on CPU); call before reading a wall clock."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated on an accelerator since start (None on CPU)."""
    if device.type == "cpu":
        return None
    return int(torch.accelerator.max_memory_allocated(device))


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of one accelerator device (None for the CPU), read from its properties, so that
    asking allocates nothing on it."""
    if device.type == "cpu":
        return None
    return int(getattr(torch, device.type).get_device_properties(device.index or 0).total_memory)
