"""One gradient norm for the whole job: every gradient element counted exactly once, whatever the layout.

A :class:`GradPiece` is a gradient tensor (a whole parameter's, or a slice of a ZeRO flat buffer) plus
the *axes it is sharded on*: the axes along which ranks hold different pieces (``tp`` for a weight split
by tensor parallelism, ``pp`` for a stage's parameters, ``ep`` for experts, ``dp_shard`` for a ZeRO slice).
Along every other axis of ``axes`` the ranks hold identical copies, so only the rank at coordinate 0 of
those axes adds the piece's squares. Summing the per-rank partial sums over every group of ``axes``
(sequential all-reduces over orthogonal axes = one sum over their product) then counts each element
exactly once. Axes not in ``axes`` (plain data parallelism, context parallelism: gradients already
reduced and identical there) need no communication: every replica computes the same total.

``axes`` must hold the same names on every rank (the layout's sharding axes, not this rank's
parameters'); reductions run in sorted name order. Communication: one all-reduce of one fp32 value per
axis of size > 1. Clipping scales every gradient by the same factor on every rank, so replicated
parameters stay identical.

:func:`clip_grad_norm` is the one entry point every layout clips through (the trainer, the pipeline,
ZeRO's sharded update and expert-parallel ZeRO); each passes its pieces (or parameters and
``axes_of``) and the layout's norm axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from tessera import comm
from tessera.comm.group import CommGroup


@dataclass(frozen=True, eq=False)
class GradPiece:
    grad: torch.Tensor  # any shape; its squares are summed in fp32
    sharded: frozenset = frozenset()  # names of the axes along which ranks hold different pieces


def local_squares(pieces: Iterable[GradPiece], axes: Mapping[str, CommGroup],
                  device: torch.device) -> torch.Tensor:
    """This rank's share of ‖g‖² (a 0-d fp32 tensor on ``device``): pieces replicated along an axis of
    ``axes`` count only at coordinate 0 of that axis."""
    mine = [piece.grad for piece in pieces  # tensor_norms detaches
            if all(group.rank == 0 for name, group in axes.items() if name not in piece.sharded)]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for norms in tensor_norms(mine):
        sq += norms.square().sum().to(device)
    return sq


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def tensor_norms(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 L2 norm of every tensor, stacked per device and dtype: [k] per group of k tensors, on
    their device. One fused kernel per group where torch has it (the one ``torch.nn.utils.clip_grad_norm_``
    uses), one reduction per tensor elsewhere (a DTensor); never an fp32 copy or a squared temporary of
    a tensor (either would be as large as the biggest parameter: gigabytes for an embedding at scale).
    A norm is inf or nan exactly when its tensor holds an inf or nan, or (finite values beyond about
    1e19 in fp32 or bf16) when its squares overflow fp32."""
    out = []
    for same in _by_device_and_dtype([t.detach() for t in tensors]):
        if all(type(t) is torch.Tensor for t in same):
            out.append(torch.stack(torch._foreach_norm(same, 2, dtype=torch.float32)))
        else:
            out.append(torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in same]))
    return out


def global_grad_norm(pieces: Iterable[GradPiece], axes: Mapping[str, CommGroup],
                     device: torch.device) -> torch.Tensor:
    """‖g‖ over the whole job (0-d fp32, the same on every rank that shares the layout)."""
    sq = local_squares(pieces, axes, device)
    for name in sorted(axes):
        comm.all_reduce(sq, axes[name])
    return sq.sqrt()


def clip_grad_norm(grads: Iterable[GradPiece] | Iterable[torch.nn.Parameter], axes: Mapping[str, CommGroup],
                   max_norm: float, axes_of: Callable[[torch.nn.Parameter], Iterable[str]] | None = None,
                   device: torch.device | None = None, scale: Iterable[torch.Tensor] | None = None) -> float:
    """The one clipping entry point of every layout: scale the gradients in place by
    min(1, max_norm / ‖g‖) (``max_norm`` ≤ 0: only measure) and return ‖g‖ before clipping, the same
    float on every rank.

    ``grads``: parameters — one piece per distinct parameter with a gradient, sharded on ``axes_of(p)``
    (default: on no axis) — or :class:`GradPiece` s already built (a ZeRO engine's slices).
    ``axes``: the layout's norm axes, the same names on every rank (``tessera.parallelize.norm_axes``,
    plus a ZeRO engine's shard group). ``device``: where the one-float sums live (the groups' device);
    default the first gradient's, and then a rank without any gradient returns 0.0 and communicates
    nothing. ``scale``: the tensors to multiply (default: the pieces' own gradients; pass the whole
    tensors when the pieces are views of them).
    """
    items = list(grads)
    if items and isinstance(items[0], GradPiece):
        if axes_of is not None:
            raise TypeError("axes_of applies to parameters; GradPieces carry their own axes")
        pieces = items
    else:
        pieces = _param_pieces(items, axes_of or (lambda p: ()))
    if device is None:
        if not pieces:
            return 0.0
        device = pieces[0].grad.device
    norm = global_grad_norm(pieces, axes, device)
    _scale_to([p.grad for p in pieces] if scale is None else scale, norm, max_norm)
    return float(norm)


@torch.no_grad()
def _scale_to(grads: Iterable[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Multiply ``grads`` in place by min(1, max_norm / norm) (``max_norm`` ≤ 0: leave them)."""
    if max_norm <= 0:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for same in _by_device_and_dtype(list(grads)):
        factor = scale.to(device=same[0].device, dtype=same[0].dtype)
        if all(type(g) is torch.Tensor for g in same):
            torch._foreach_mul_(same, factor)
        else:
            for g in same:
                g.mul_(factor)


def _param_pieces(params: Iterable[torch.nn.Parameter], axes_of) -> list[GradPiece]:
    """One piece per distinct parameter with a gradient, sharded on ``axes_of(p)`` (a Parameter listed
    twice, as a tied weight can be, counts once)."""
    seen, out = set(), []
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        out.append(GradPiece(p.grad, frozenset(axes_of(p))))
    return out
