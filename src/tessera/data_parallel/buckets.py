"""Gradient buckets: parameters grouped into flat buffers that are all-reduced as one message each.

Parameters are taken in *reverse* registration order, because backward produces the gradients of the
last layers first; a bucket is full (and its all-reduce can start) as soon as every parameter in it has
its gradient. Each bucket holds one dtype and one device; a bucket is closed when adding the next
parameter would pass the size cap (a parameter larger than the cap gets a bucket of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor  # flat [sum(numel)], dtype/device of its parameters
    offsets: list[int]
    ready: int = 0  # gradients produced in the current backward pass
    handle: object = None
    used: set[int] = field(default_factory=set)  # ids of params whose gradient arrived this pass

    def view(self, i: int) -> torch.Tensor:
        """The slice of ``buffer`` that holds parameter i's gradient, shaped like the parameter."""
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    @property
    def full(self) -> bool:
        return self.ready == len(self.params)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.ready = 0
        self.handle = None
        self.used.clear()


def build_buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Buckets over ``params`` in the given order (pass them reversed), one open bucket per dtype/device."""
    groups: list[list[torch.nn.Parameter]] = []
    open_group: dict[tuple, tuple[list, int]] = {}  # (dtype, device) → (params, bytes so far)
    for p in params:
        key = (p.dtype, p.device)
        members, size = open_group.get(key, (None, 0))
        p_bytes = p.numel() * p.element_size()
        if members is None or (members and size + p_bytes > cap_bytes):
            members, size = [], 0
            groups.append(members)
        members.append(p)
        open_group[key] = (members, size + p_bytes)
    buckets = []
    for index, members in enumerate(groups):
        offsets, total = [], 0
        for p in members:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
        buckets.append(Bucket(index, members, buffer, offsets))
    return buckets
