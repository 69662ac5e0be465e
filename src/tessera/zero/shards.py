"""The local half of every ZeRO stage: fp32 master shards, the optimizer over them, and the update.

A :class:`Shard` is this rank's 1/N slice of one flat parameter buffer (a ZeRO-1/2 bucket or a ZeRO-3
unit): ``param`` is the compute-dtype slice that is all-gathered, ``grad`` the reduced gradient slice
(in the reduce dtype) and ``master`` the fp32 weights the optimizer steps. In fp32 without offload
``master`` *is* ``param`` (no copy); with mixed precision or offload it is a separate fp32 tensor,
on the host when offloading. Any optimizer whose update is elementwise (AdamW, SGD, Adagrad) gives the
same result on the slices as on the whole tensors, so sharding does not change the math.

Disk offload (:meth:`ShardedUpdate.offload_to_disk`, ``tessera.zero.offload``): each master moves into a
file (``param`` stays in RAM, a separate tensor even in fp32) and the optimizer becomes a
:class:`~tessera.zero.offload.StreamedAdamW`, whose step streams masters and state through a few chunk
buffers and refreshes ``param`` chunk by chunk as it goes; the master gradients stay in RAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.grad_norm import GradPiece, clip_grad_norm
from tessera.precision.unscale import agree_finite, nonfinite
from tessera.zero.offload import OffloadFolder, disk_master, for_disk_masters, on_disk
from tessera.zero.offload.overlap import land_grads


@dataclass(eq=False)
class Shard:
    param_group: int  # index of the optimizer param group (e.g. with / without weight decay)
    param: torch.Tensor  # [n] compute dtype; what the all-gather sends
    master: nn.Parameter | None  # [n] fp32, on the offload device when offloading; None: frozen (ZeRO-3)
    grad: torch.Tensor | None = None  # [n] reduce dtype; None until the first reduction
    # (start, end, extra sharded axes) per parameter part of the slice, for the global norm; None: the
    # whole slice, sharded over the shard group only
    segments: list[tuple[int, int, frozenset]] | None = None
    copies: object | None = None  # host offload: its HostCopies (tessera.zero.offload.overlap), else None


def make_master(param_shard: torch.Tensor, offload_device: torch.device | None) -> nn.Parameter:
    """fp32 master weights for a shard: the shard itself when already fp32 and not offloaded."""
    if param_shard.dtype == torch.float32 and offload_device is None:
        return nn.Parameter(param_shard, requires_grad=True)
    host = param_shard.detach().to(offload_device or param_shard.device, dtype=torch.float32, copy=True)
    return nn.Parameter(host, requires_grad=True)


class ShardedUpdate:
    """Runs the optimizer on master shards; unscales, checks finiteness and clips across all shards.

    ``make_optimizer(param_groups)`` builds the torch optimizer; ``group_options[g]`` are the extra
    options of group g (e.g. ``{"weight_decay": 0.1}``). ``shard_group`` holds the different slices
    (their norms are summed); ``check_groups`` are groups that together span the job (shard, replicate
    and every norm axis), so an overflow anywhere makes every rank skip the step.
    ``norm_axes``: further axes some parameters are split on (e.g. ``{"tp": group}`` when the model is
    tensor-parallel); a shard's ``segments`` say which parts of it are (see ``tessera.grad_norm``).
    """

    def __init__(self, shards: list[Shard], group_options: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 shard_group: CommGroup, check_groups: list[CommGroup], device: torch.device,
                 norm_axes: dict[str, CommGroup] | None = None):
        self.shards = shards
        self.device = device  # where the small flag / norm tensors live (NCCL needs the accelerator)
        self.shard_group = shard_group
        self.norm_axes = {"dp_shard": shard_group, **(norm_axes or {})}
        self.check_groups = check_groups
        self.group_options, self.make_optimizer = group_options, make_optimizer
        self.optimizer = self._build_optimizer()

    def _build_optimizer(self) -> torch.optim.Optimizer | None:
        groups = [{"params": [s.master for s in self.shards if s.param_group == g], **opts}
                  for g, opts in enumerate(self.group_options)]
        groups = [g for g in groups if g["params"]]
        # no shards (e.g. the expert part of a pipeline stage without MoE layers): no optimizer, yet the
        # finiteness and norm collectives below still run, so every rank of the job issues them alike
        return for_disk_masters(self.make_optimizer(groups)) if groups else None

    @torch.no_grad()
    def offload_to_disk(self, folder: OffloadFolder) -> torch.optim.Optimizer | None:
        """Move every master into a file of ``folder``, one shard at a time (each in-RAM master is freed
        once copied), and rebuild the optimizer over them as a streaming one; returns it. Call before
        the first step, with no optimizer state yet."""
        self.optimizer = None  # it holds the masters in RAM: drop it so that each is freed as it moves
        for s in self.shards:
            s.master = disk_master(s.master, s.param, folder)
        self.optimizer = self._build_optimizer()
        ensure_files = getattr(self.optimizer, "ensure_state", None)
        if ensure_files is not None:  # the moments' files now: a full disk is an error at start, not in a step
            ensure_files()
        return self.optimizer

    @torch.no_grad()
    def prepare_grads(self, inv_scale: float) -> bool:
        """master.grad = fp32(grad) / loss scale (on the master's device); returns whether all ranks'
        gradients are finite (one tiny all-reduce per check group)."""
        land_grads(self.shards)  # host offload: the gradient copies still in flight land here
        for s in self.shards:
            g = s.grad if s.grad is not None else torch.zeros_like(s.param)
            g32 = g.to(s.master.device, dtype=torch.float32, non_blocking=True)
            if g32.data_ptr() == g.data_ptr():
                g32 = g32 if inv_scale == 1.0 else g32.mul(inv_scale)
            elif inv_scale != 1.0:
                g32.mul_(inv_scale)
            s.master.grad = g32
        return agree_finite(nonfinite([s.master.grad for s in self.shards], self.device), self.check_groups)

    @torch.no_grad()
    def clip(self, max_norm: float) -> float:
        """Global L2 norm of the gradient over every shard (each element counted once); scale to max_norm."""
        return clip_grad_norm(self.norm_pieces(), self.norm_axes, max_norm, device=self.device,
                              scale=[s.master.grad for s in self.shards])  # the pieces are views of these

    def norm_pieces(self) -> list[GradPiece]:
        """The master gradients as norm pieces: each slice (or each parameter's part of it) is
        sharded over the shard group, plus the axes its segment names."""
        pieces = []
        for s in self.shards:
            g = s.master.grad
            if s.segments is None:
                pieces.append(GradPiece(g, frozenset({"dp_shard"})))
                continue
            pieces += [GradPiece(g[a:b], frozenset({"dp_shard"}) | axes) for a, b, axes in s.segments]
        return pieces

    @torch.no_grad()
    def step(self) -> None:
        """Optimizer step on the masters, then the compute-dtype shards take the new values."""
        self.optimizer.step()
        self.refresh_params()

    @torch.no_grad()
    def refresh_params(self) -> None:
        """The compute-dtype shards take the masters' values (where they are separate tensors)."""
        for s in self.shards:  # a file-backed master's shard was refreshed by the streaming step itself
            if s.master.data_ptr() != s.param.data_ptr() and not on_disk(s.master):
                s.param.copy_(s.master.detach(), non_blocking=True)

    def zero_grad(self) -> None:
        land_grads(self.shards)  # no copy in flight may land after the zeros
        for s in self.shards:
            s.master.grad = None
            s.grad = None  # the next reduced slice takes its place (no zeroing, no adding into zeros)

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Model-state tensors this rank holds, by MemoryLedger category (masters count as optimizer
        state when they are separate from the parameters, as in the ZeRO paper's K). File-backed masters
        and state (disk offload) are not held in RAM and are not listed."""
        masters = [s.master for s in self.shards if s.master.data_ptr() != s.param.data_ptr()
                   and not on_disk(s.master)]
        states = [v for st in self.optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and not on_disk(v)]
        return {"params": [s.param for s in self.shards], "grads": [s.grad for s in self.shards],
                "optimizer": masters + states}
