"""AdamW whose fp32 master weights and state live in files: the step streams them through RAM chunk by chunk.

Per step, for every master [n] and every chunk [a, b) of it (``chunk`` elements, a whole number of pages)::

    reader thread   populate  master, exp_avg, exp_avg_sq [a', b')   (the next chunk, from the file)
    this thread     AdamW on  master, exp_avg, exp_avg_sq, grad [a, b); param[a:b] = master[a:b]
    writer thread   start writing the previous chunk's three to their files, and unmap them

so at most three chunks of state are mapped in (read ahead, updating, writing back): the step's RAM is
3 chunks × 3 tensors × 4 B × chunk elements plus the update's two temporaries of one chunk each, whatever
the model's size. The master gradients [n] stay in RAM (the engine unscales and clips them in place).

The update of a chunk is torch's own AdamW (``torch.optim.adam.adam`` with decoupled weight decay) on the
chunk's views, in the template's implementation (single-tensor by default; foreach or fused when the
template was built with them: ``[kernels] adamw``). It is elementwise, so the chunks give bit for bit what
one call on the whole tensors gives — what ``torch.optim.AdamW`` with those flags computes for a CPU
parameter. The step counter is per master,
as torch keeps it: each chunk counts from the same value, and the master's counter advances once.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.optim.adam import adam

from tessera.zero.offload.files import OffloadFolder, chunks, populate, write_back

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def on_disk(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a master or an optimizer state tensor backed by an offload file."""
    return getattr(t, "offload_folder", None) is not None


def disk_master(master: torch.Tensor, param: torch.Tensor, folder: OffloadFolder) -> nn.Parameter:
    """A copy of ``master`` [n] (fp32) in a file of ``folder``, written chunk by chunk; ``param`` [n] (the
    compute-dtype shard the all-gather sends) takes its values after every step (``offload_mirror``)."""
    data = folder.tensor(master.numel(), "master")
    with torch.no_grad():
        for a, b in chunks(master.numel(), folder.chunk):
            data[a:b].copy_(master.detach()[a:b])
            write_back(data, a, b)
    out = nn.Parameter(data, requires_grad=True)
    out.offload_folder, out.offload_fd, out.offload_mirror = folder, data.offload_fd, param
    return out


def for_disk_masters(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """``optimizer`` itself, or a :class:`StreamedAdamW` with its groups and settings when some of its
    parameters live in offload files."""
    if optimizer is None or isinstance(optimizer, StreamedAdamW):
        return optimizer
    if not any(on_disk(p) for g in optimizer.param_groups for p in g["params"]):
        return optimizer
    return StreamedAdamW(optimizer)


class StreamedAdamW(torch.optim.AdamW):
    """The AdamW (or Adam) ``template`` — same groups, same settings, so a learning-rate scheduler drives
    ``param_groups[g]["lr"]`` as before — whose state of a file-backed master is created in files of the
    master's folder and whose :meth:`step` streams it (see the module docstring). ``bytes_read`` /
    ``bytes_written`` count what the steps moved between the files and RAM."""

    def __init__(self, template: torch.optim.Optimizer):
        if not isinstance(template, torch.optim.Adam):  # AdamW is an Adam
            raise TypeError(f"disk offload streams Adam/AdamW state only, not {type(template).__name__}")
        for flag in ("capturable", "differentiable"):  # graph capture / autograd through the step: not streamed
            if any(g.get(flag) for g in template.param_groups):
                raise ValueError(f"disk offload streams the step chunk by chunk; {flag}=True is not supported")
        torch.optim.Optimizer.__init__(self, [dict(g) for g in template.param_groups], dict(template.defaults))
        self.bytes_read = self.bytes_written = 0

    def ensure_state(self) -> None:
        """The state a first step creates (step 0, zero moments; in files for file-backed masters), for
        every parameter without one: a checkpoint can then be loaded into it in place."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]:
                    continue
                keys = STATE_KEYS + (("max_exp_avg_sq",) if group["amsgrad"] else ())
                folder = getattr(p, "offload_folder", None)
                state = {"step": torch.zeros((), dtype=torch.float32)}
                for key in keys:
                    state[key] = torch.zeros_like(p.detach()) if folder is None else folder.tensor(p.numel(), key)
                self.state[p] = state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ensure_state()
        work = [(group, p, a, b) for group in self.param_groups for p in group["params"] if p.grad is not None
                for a, b in chunks(p.numel(), p.offload_folder.chunk if on_disk(p) else max(p.numel(), 1))]
        self._stream(work)
        return loss

    def _stream(self, work: list) -> None:
        """Read ahead one chunk, update one, write back one (see the module docstring)."""
        if not work:
            return
        with ThreadPoolExecutor(1, "tessera-offload-read") as reader, \
                ThreadPoolExecutor(1, "tessera-offload-write") as writer:
            ahead = reader.submit(self._read, *work[0])
            writing: deque = deque()
            for i, item in enumerate(work):
                ahead.result()
                if i + 1 < len(work):
                    ahead = reader.submit(self._read, *work[i + 1])
                self._update(*item)
                writing.append(writer.submit(self._write, *item))
                while len(writing) > 1:  # the previous chunk's write-back overlapped this update
                    writing.popleft().result()
            for pending in writing:
                pending.result()

    def _on_disk(self, p: torch.Tensor) -> list[torch.Tensor]:
        """The file-backed tensors of master ``p``: itself and its state [n] (none for a master in RAM)."""
        if not on_disk(p):
            return []
        state = self.state[p]
        return [p] + [state[k] for k in state if k != "step" and state[k].dim()]

    def _read(self, group, p, a, b) -> None:
        for t in self._on_disk(p):
            populate(t, a, b)
            self.bytes_read += (b - a) * t.element_size()

    def _write(self, group, p, a, b) -> None:
        for t in self._on_disk(p):
            write_back(t, a, b)
            self.bytes_written += (b - a) * t.element_size()

    def _update(self, group: dict, p: torch.Tensor, a: int, b: int) -> None:
        """torch's AdamW (the group's foreach / fused choice) on chunk [a, b) of ``p``; the compute-dtype
        mirror takes the values."""
        state, amsgrad = self.state[p], group["amsgrad"]
        step = state["step"].clone()  # adam() advances it; every chunk of p starts from the same count
        master = p.detach()[a:b]
        adam([master], [p.grad[a:b]], [state["exp_avg"][a:b]], [state["exp_avg_sq"][a:b]],
             [state["max_exp_avg_sq"][a:b]] if amsgrad else [], [step], foreach=bool(group.get("foreach")),
             fused=bool(group.get("fused")),
             capturable=False, differentiable=False, has_complex=False,
             decoupled_weight_decay=group.get("decoupled_weight_decay", True), amsgrad=amsgrad,
             beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"])
        mirror = getattr(p, "offload_mirror", None)
        if mirror is not None:
            mirror[a:b].copy_(master, non_blocking=True)
        if b == p.numel():
            state["step"].copy_(step)

    @torch.no_grad()
    def settle(self) -> None:
        """Write every file-backed tensor to its file and unmap it (after a checkpoint wrote into them)."""
        for group in self.param_groups:
            for p in group["params"]:
                for t in self._on_disk(p):
                    write_back(t, 0, t.numel())


@torch.no_grad()
def refresh_mirror(master: torch.Tensor) -> None:
    """The compute-dtype shard takes a file-backed master's values (after a checkpoint load), chunk by
    chunk, each chunk unmapped once copied."""
    for a, b in chunks(master.numel(), master.offload_folder.chunk):
        master.offload_mirror[a:b].copy_(master.detach()[a:b])
        write_back(master, a, b)
