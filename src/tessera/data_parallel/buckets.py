"""Gradient buckets: parameters grouped into flat buffers that are reduced as one message each.

The one bucket builder of every data-parallel engine (DDP, ZeRO-1/2, the pipeline's dp reduction).
Parameters are taken in the order given, which callers make *reverse* registration order, because
backward produces the gradients of the last layers first; a bucket is full (and its reduction can start)
as soon as every parameter in it has its gradient. A bucket holds one key (optimizer param group, dtype,
device): a new bucket starts when the key changes or when adding the next parameter would pass the size
cap (a parameter larger than the cap gets a bucket of its own). With ``pad_to = N`` a bucket's buffer is
padded to a multiple of N elements (at least N) so N ranks get equal slices (ZeRO); padding stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tessera.comm.flat import offsets_of


def padded_size(numel: int, world: int) -> int:
    """The smallest multiple of ``world`` that holds ``numel`` elements (at least ``world``)."""
    return max(-(-numel // world), 1) * world


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter's gradient starts in the buffer
    size: int  # elements in the buffer, padding included
    param_group: int = 0  # index of the optimizer param group of every parameter in it
    buffer: torch.Tensor | None = None  # [size] gradients, dtype/device of the parameters; None while not held
    filled: set[int] = field(default_factory=set)  # parameter indices whose slot was written this pass
    empty: set[int] = field(default_factory=set)  # ... of those, the ones that had no gradient (zeros)
    pending: object = None  # the reduction in flight

    def allocate(self) -> torch.Tensor:
        """The buffer, made if not held. Only its padding is zeroed: the reducer writes every slot (a
        gradient, or zeros) before a reduction reads the buffer, so zeroing it all would be one more pass
        over every gradient byte, each step for engines that release their buffers (ZeRO-1/2)."""
        if self.buffer is None:
            p = self.params[0]
            self.buffer = torch.empty(self.size, dtype=p.dtype, device=p.device)
            self.buffer[self.offsets[-1] + self.params[-1].numel():].zero_()
        return self.buffer

    def view(self, i: int) -> torch.Tensor:
        """The slice of ``buffer`` that holds parameter i's gradient, shaped like the parameter."""
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    @property
    def full(self) -> bool:
        return len(self.filled) == len(self.params)

    @property
    def nbytes(self) -> int:
        return self.size * self.params[0].element_size()


def build_buckets(params: list[nn.Parameter], cap_bytes: int, group_of: Callable[[nn.Parameter], int] | None = None,
                  pad_to: int = 1, fill_to_cap: bool = False) -> list[Bucket]:
    """Buckets over ``params`` in the given order (pass them reversed); ``group_of(p)``: p's optimizer
    param group (default: one group). No buffer is allocated yet (see :meth:`Bucket.allocate`).

    The cap is a ceiling by default: the next parameter starts a new bucket if it would pass it (ZeRO
    allocates its buckets during backward and frees them once reduced, so the cap bounds memory).
    ``fill_to_cap``: a bucket closes only once it holds the cap, so its last parameter may pass it, as
    torch's DDP lays its buckets. DDP's buckets are allocated once and hold every gradient whatever their
    boundaries, so there the cap sets only the message size, and fuller messages mean fewer of them
    (6 instead of 8 for the small preset at a 2 MiB cap: each one costs a fixed launch and wake-up)."""
    runs: list[tuple[tuple, list[nn.Parameter]]] = []
    size = 0
    for p in params:
        key = (group_of(p) if group_of is not None else 0, p.dtype, p.device)
        p_bytes = p.numel() * p.element_size()
        full = size >= cap_bytes if fill_to_cap else size + p_bytes > cap_bytes
        if not runs or runs[-1][0] != key or full:
            runs.append((key, []))
            size = 0
        runs[-1][1].append(p)
        size += p_bytes
    buckets = []
    for index, (key, members) in enumerate(runs):
        offsets, total = offsets_of(members)
        buckets.append(Bucket(index, members, offsets, padded_size(total, pad_to), param_group=key[0]))
    return buckets


def in_arrival_order(buckets: list[Bucket], arrival: list[nn.Parameter]) -> list[Bucket]:
    """``buckets`` sorted by when backward is expected to fill them: by the latest expected arrival of
    their parameters' gradients (``arrival``: every parameter, usually in reverse registration order).

    This is the launch order for buckets built in another order: ZeRO's follow the param groups (all
    norm weights of the model in one bucket, say), and launched by index that bucket would hold every
    later one — and its full gradients — until the end of backward. The order depends only on the
    model, so it is the same on every rank; the buckets' contents (and the numerics) do not change.
    """
    position = {id(p): i for i, p in enumerate(arrival)}
    return sorted(buckets, key=lambda b: max(position.get(id(p), len(position)) for p in b.params))
