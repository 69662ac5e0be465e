"""Dropout randomness under tensor parallelism.

Where activations are replicated over tp (the residual stream without SP) every tp rank must drop the
same elements, or the replicas drift apart; where they are split (attention heads, the sequence slices
under SP) the ranks must draw different masks, or the split dimension would see one mask repeated N
times. Each dropout call draws a base seed from the global RNG — identical on the tp ranks, which seed it
alike — and seeds a private generator with it ("replicated") or with it plus an offset and the tp rank
("split"). Because the base comes from the global RNG, activation checkpointing, which restores that RNG
before recomputing, replays the same masks. The attention core's dropout happens inside SDPA and cannot
take a generator, so it runs under :meth:`TensorParallelRNG.split_region`, which forks the global RNG.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tessera.comm.group import CommGroup

_SPLIT_OFFSET = 2718  # keeps the split streams away from the replicated one (Megatron uses the same idea)
_MAX_SEED = 2**62


class TensorParallelRNG:
    """Seeds of the two dropout streams of one tp rank; ``seed`` is mixed into every draw."""

    def __init__(self, group: CommGroup, seed: int):
        self.group, self.seed = group, seed

    def _seed(self, kind: str) -> int:
        base = int(torch.randint(0, _MAX_SEED, (1,)))  # global CPU RNG: same on every tp rank
        offset = 0 if kind == "replicated" else _SPLIT_OFFSET + 1 + self.group.rank
        return (base + self.seed + offset) % _MAX_SEED

    def generator(self, kind: str, device: torch.device) -> torch.Generator:
        """A fresh generator for one dropout call on ``device`` ("replicated" or "split" stream)."""
        return torch.Generator(device=device).manual_seed(self._seed(kind))

    @contextlib.contextmanager
    def split_region(self, device: torch.device):
        """Run code whose RNG calls cannot take a generator (SDPA dropout) on this rank's split stream."""
        seed = self._seed("split")
        devices = [device] if device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(seed)
            yield


class TensorParallelDropout(nn.Module):
    """Inverted dropout drawing its mask from one of the two streams (``kind`` "replicated" or "split")."""

    def __init__(self, p: float, rng: TensorParallelRNG, kind: str):
        super().__init__()
        if kind not in ("replicated", "split"):
            raise ValueError(f"dropout kind must be 'replicated' or 'split', got {kind!r}")
        self.p, self.rng, self.kind = p, rng, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.rng.generator(self.kind, x.device))
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.kind}"
