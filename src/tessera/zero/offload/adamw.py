"""The optimizer step whose fp32 master weights and state live in files: it streams them through RAM chunk by
chunk. AdamW (and Adam, SGD, Adagrad: ``optim.name``) — the class keeps the name it was born with.

Per step, for every master [n] and every chunk [a, b) of it (``chunk`` elements, a whole number of pages)::

    reader thread   populate  master and its state [a', b')   (the next chunk, from the files)
    this thread     update    master, state, grad [a, b); param[a:b] = master[a:b]
    writer thread   start writing the previous chunk's tensors to their files, and unmap them

so at most three chunks of state are mapped in (read ahead, updating, writing back): the step's RAM is
3 chunks × (1 + k) tensors × 4 B × chunk elements (k state tensors: AdamW/Adam 2, SGD with momentum 1, plain
SGD 0, Adagrad 1) plus the update's temporaries of one chunk each, whatever the model's size. The master
gradients [n] stay in RAM (the engine unscales and clips them in place).

The update of a chunk is torch's own (``torch.optim.adam.adam`` with or without decoupled weight decay,
``torch.optim.sgd.sgd``, ``torch.optim.adagrad.adagrad``) on the chunk's views, in the template's
implementation (single-tensor by default; foreach or fused when the template was built with them:
``[kernels] adamw``). It is elementwise, so the chunks give bit for bit what one call on the whole tensors
gives — what the torch optimizer with those flags computes for a CPU parameter. The step counter (Adam,
Adagrad) is per master, as torch keeps it: each chunk counts from the same value, and the master's counter
advances once. SGD's momentum buffer starts at zero rather than as a copy of the first gradient: with
dampening 0 the two give the same buffer after the first step.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from tessera.zero.offload.files import OffloadFolder, chunks, populate, write_back

STATE_KEYS = ("exp_avg", "exp_avg_sq")  # Adam / AdamW; SGD: momentum_buffer; Adagrad: sum (see state_keys)


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


def optimizer_kind(template: torch.optim.Optimizer) -> str:
    """"adam" (Adam and AdamW), "sgd" or "adagrad": the update :class:`StreamedAdamW` streams for ``template``."""
    for cls, kind in ((torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd"), (torch.optim.Adagrad, "adagrad")):
        if isinstance(template, cls):  # AdamW is an Adam
            return kind
    raise TypeError(f"disk offload streams Adam/AdamW, SGD and Adagrad state, not {type(template).__name__}")


def state_keys(kind: str, group: dict) -> tuple[str, ...]:
    """The [n] state tensors a master of ``group`` keeps (besides the 0-d step of Adam and Adagrad): the one
    list of names, which :func:`tessera.checkpoint.state.ensure_optimizer_state` creates too."""
    if kind == "sgd":
        return ("momentum_buffer",) if group["momentum"] else ()
    if kind == "adagrad":
        return ("sum",)
    return STATE_KEYS + (("max_exp_avg_sq",) if group["amsgrad"] else ())


class StreamedAdamW(torch.optim.AdamW):
    """The AdamW, Adam, SGD or Adagrad ``template`` — same groups, same settings, so a learning-rate
    scheduler drives ``param_groups[g]["lr"]`` as before — whose state of a file-backed master is created in
    files of the master's folder and whose :meth:`step` streams it (see the module docstring).
    ``bytes_read`` / ``bytes_written`` count what the steps moved between the files and RAM."""

    def __init__(self, template: torch.optim.Optimizer):
        self.kind = optimizer_kind(template)
        for flag in ("capturable", "differentiable"):  # graph capture / autograd through the step: not streamed
            if any(g.get(flag) for g in template.param_groups):
                raise ValueError(f"disk offload streams the step chunk by chunk; {flag}=True is not supported")
        if any(g.get("initial_accumulator_value") or g.get("lr_decay") for g in template.param_groups):
            raise ValueError("disk offload streams Adagrad with initial_accumulator_value 0 and lr_decay 0 only")
        torch.optim.Optimizer.__init__(self, [dict(g) for g in template.param_groups], dict(template.defaults))
        self.bytes_read = self.bytes_written = 0

    def ensure_state(self) -> None:
        """The state a first step creates (step 0, zero moments / buffer / sum; in files for file-backed
        masters), for every parameter without one: a checkpoint can then be loaded into it in place."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]:
                    continue
                folder = getattr(p, "offload_folder", None)
                state = {} if self.kind == "sgd" else {"step": torch.zeros((), dtype=torch.float32)}
                for key in state_keys(self.kind, group):
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
        """torch's update of the template's kind (the group's foreach / fused choice) on chunk [a, b) of
        ``p``; the compute-dtype mirror takes the values."""
        state, master, grad = self.state[p], p.detach()[a:b], p.grad[a:b]
        flags = {"foreach": bool(group.get("foreach")), "fused": bool(group.get("fused"))}
        step = state["step"].clone() if "step" in state else None  # every chunk of p starts from the same count
        if self.kind == "sgd":
            buffers = [state["momentum_buffer"][a:b]] if group["momentum"] else [None]
            sgd([master], [grad], buffers, **flags, weight_decay=group["weight_decay"], momentum=group["momentum"],
                lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
        elif self.kind == "adagrad":
            adagrad([master], [grad], [state["sum"][a:b]], [step], **flags, lr=group["lr"],
                    weight_decay=group["weight_decay"], lr_decay=0.0, eps=group["eps"], maximize=group["maximize"])
        else:
            amsgrad = group["amsgrad"]
            adam([master], [grad], [state["exp_avg"][a:b]], [state["exp_avg_sq"][a:b]],
                 [state["max_exp_avg_sq"][a:b]] if amsgrad else [], [step], **flags,
                 capturable=False, differentiable=False, has_complex=False,
                 decoupled_weight_decay=group.get("decoupled_weight_decay", True), amsgrad=amsgrad,
                 beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=group["maximize"])
        mirror = getattr(p, "offload_mirror", None)
        if mirror is not None:
            mirror[a:b].copy_(master, non_blocking=True)
        if step is not None and b == p.numel():
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
