"""Host offload (``zero.offload = "host"``) with its copies overlapped with compute, as DeepSpeed's
``overlap_comm`` does: the device→host gradient copies run beside the rest of the backward and the
host→device parameter copies beside the forward; each waits exactly where its data is needed.

Shapes: a shard's reduced gradient slice ``out`` [n] (reduce dtype) arrives on the device when its
bucket's (ZeRO-1/2) or unit's (ZeRO-3) reduction completes; the fp32 master [n] and the optimizer state
live on the host; ZeRO-3 also keeps its parameter shard ``param`` [n] on the host between uses.

Gradients, device→host. :meth:`HostCopies.add_grad` (called by ``tessera.zero.reduce.accumulate`` for a
shard that has copies) starts copying ``out`` into a host buffer on a side stream, after the compute
stream's work so far, and returns at once: the copy runs while backward computes the next buckets or
units. The host adds the buffer into ``shard.grad`` (on the host) only when it must read it:
:meth:`HostCopies.land` before the next reduction of the same shard, and before the step reads or clears
the gradients (``ShardedUpdate.prepare_grads`` / ``zero_grad``). ``out`` is held until then, so its device
memory is not reused while the copy reads it.

Parameters, host→device. ZeRO-3 gathers a unit from its host shard (``FlatParam.gather``, also ahead of
time for the ``zero.prefetch`` next units): :meth:`HostCopies.to_device` copies it on the side stream into
a buffer allocated on the compute stream, and the compute stream waits for that copy just before the
all-gather reads it, so the copy of the next unit runs beside this unit's forward. ZeRO-1/2 copy the
updated masters into their device slices in ``ShardedUpdate.refresh_params`` on the compute stream, right
before the all-gathers that need them; with pinned masters those copies no longer block the host.

All copies of an engine go on one side stream, in order. The host step writes the masters (ZeRO-3 fp32: the
parameter shards themselves) only after :meth:`HostCopies.land` waited for every gradient copy, and every
trainable shard's gradient copy of the step was issued after its last parameter copy, so no parameter copy
still reads a shard the step writes.

Host buffers are pinned (page-locked) where an accelerator exists, so the copies are truly asynchronous.
Where the device *is* the host (a CPU job) nothing is copied: ``out`` is added in as it is. The copier is
replaceable: :class:`InlineCopier` copies at once (a CPU-type device, as under
``tessera.testing.emulated_accelerator``), :class:`StreamCopier` on an accelerator's side stream; a test
can pass one that delays every copy until it is waited for, to check that nothing reads too early.
"""

from __future__ import annotations

import torch


class InlineCopier:
    """Copies at once (the device is a CPU device): nothing is in flight, nothing to wait for."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        dst.copy_(src)
        return None

    def wait_host(self, ready) -> None:
        pass

    def wait_device(self, ready) -> None:
        pass


class StreamCopier:
    """Copies on a side stream of ``device`` (torch.Stream / torch.Event: any accelerator)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.Stream(device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        # after the compute stream's work so far: it produced src, or last used dst's memory
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:
            dst.copy_(src, non_blocking=True)
        return self.stream.record_event()

    def wait_host(self, ready) -> None:
        ready.synchronize()

    def wait_device(self, ready) -> None:
        torch.accelerator.current_stream(self.device).wait_event(ready)


def default_copier(device: torch.device):
    return InlineCopier() if device.type == "cpu" else StreamCopier(device)


class HostCopies:
    """The in-flight gradient copies of one engine's offloaded shards, and its parameter copies."""

    def __init__(self, device: torch.device, copier=None):
        self.device = device
        self.copier = copier or default_copier(device)
        self.pin = device.type != "cpu"  # page-locked host buffers: asynchronous copies
        self.pending: dict[int, tuple] = {}  # id(shard) -> (shard, host buffer [n], device out [n], ready)

    def add_grad(self, shard, out: torch.Tensor) -> None:
        """Start moving a reduced slice ``out`` [n] to the host; it is added into ``shard.grad`` later."""
        self.land(shard)
        host = shard.master.device
        if out.device == host:  # the device is the host: nothing to copy
            _add(shard, out)
            return
        buffer = torch.empty(out.shape, dtype=out.dtype, device=host, pin_memory=self.pin)
        self.pending[id(shard)] = (shard, buffer, out, self.copier.copy(buffer, out))

    def land(self, shard=None) -> None:
        """The host waits for ``shard``'s copy in flight (every shard's when None) and adds it in."""
        keys = list(self.pending) if shard is None else [id(shard)] if id(shard) in self.pending else []
        for key in keys:
            owner, buffer, _, ready = self.pending.pop(key)
            self.copier.wait_host(ready)
            _add(owner, buffer)

    def to_device(self, host_shard: torch.Tensor) -> torch.Tensor:
        """``host_shard`` [n] copied to the device on the side stream; the compute stream waits for the
        copy before anything it queues next (the all-gather that reads it)."""
        out = torch.empty(host_shard.shape, dtype=host_shard.dtype, device=self.device)
        ready = self.copier.copy(out, host_shard)
        self.copier.wait_device(ready)
        return out


def _add(shard, grad: torch.Tensor) -> None:
    if shard.grad is None:
        shard.grad = grad
    else:
        shard.grad.add_(grad)


def land_grads(shards) -> None:
    """Before the step reads or clears the gradients of ``shards``: every copy in flight has landed."""
    for copies in {id(s.copies): s.copies for s in shards if s.copies is not None}.values():
        copies.land()


def overlap_host_copies(engine, device: torch.device, copier=None):
    """Give every offloaded shard of ``engine`` (a ZeRO-1/2/3 engine with ``zero.offload = "host"``) one
    :class:`HostCopies`, and pin its host tensors where an accelerator exists; returns the engine."""
    copies = HostCopies(device, copier)
    for s in engine.update.shards:
        if s.master is None:  # a frozen flat: no gradient, no master
            continue
        if copies.pin:
            _pin(s)
        s.copies = copies
    return engine


@torch.no_grad()
def _pin(shard) -> None:
    """Move the shard's host tensors (master [n] fp32; ZeRO-3's param [n], which may be the master itself)
    into page-locked memory, keeping the master's identity (the optimizer holds it)."""
    same = shard.param.data_ptr() == shard.master.data_ptr()
    shard.master.data = shard.master.data.pin_memory()
    if same:
        shard.param = shard.master.data
    elif shard.param.device.type == "cpu":
        shard.param = shard.param.pin_memory()
