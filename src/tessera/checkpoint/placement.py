"""Where a tensor this rank holds sits in the single-process model: its name, global shape and region.

A :class:`Placement` describes one *local parameter* (as this rank's modules hold it) in terms of the
single-process parameter it is part of. The layouts compose by layering:

- name: the local qualified name, with an expert-parallel rank's local expert index ``i`` replaced by the
  global ``expert_offset + i``, and a pipeline's last-stage copy of a tied head (``output.weight``) named as
  the single-process parameter it is tied to (``tok_embeddings.weight``);
- region: from the module type, not the layout that built it, so the same rule holds under ZeRO-3 (which
  keeps the module but drops its parameter attributes), pipeline stages and tensor parallelism together:
  ColumnParallelLinear / VocabParallelHead hold a block of rows, RowParallelLinear a block of columns,
  VocabParallelEmbedding a block of rows; rows past the vocabulary (padding to a multiple of tp) are not
  part of the single-process tensor and are cut off. The 2D / 2.5D / 3D layers (``tensor_parallel.nd``)
  hold a rectangle their ``region(shape)`` names, as does a LoRA factor a tensor-parallel layer cut from a
  dense adapter (``tensor_parallel.adapters``): any module with a ``region`` method names its own.
  Everything else is held whole (replicated);
- flat ranges: a ZeRO rank holds a range ``[a, b)`` of a local parameter's flattened (C-contiguous)
  elements; :func:`flat_boxes` cuts it into at most 2·(ndim−1)+1 rectangles of the local tensor, and
  :meth:`Placement.piece` maps each through the region.

Legend: O out features, I in features, N tp size, V vocabulary, Vp = V padded to a multiple of N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tessera.checkpoint.pieces import Piece
from tessera.moe.expert_parallel import ExpertParallelMoE
from tessera.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear, is_sharded
from tessera.tensor_parallel.vocab import VocabParallelEmbedding

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a rectangle in some tensor


@dataclass(frozen=True)
class Placement:
    """A local tensor of shape ``local_shape`` is the region of single-process tensor ``name`` (shape
    ``global_shape``) that starts at ``offsets``; only its leading ``extent`` is real (padding cut)."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    extent: tuple[int, ...]

    def piece(self, key: str, tensor: torch.Tensor, box: Box | None = None) -> Piece | None:
        """The Piece named ``key`` (a checkpoint name of this tensor, e.g. ``model/<name>``) for
        ``tensor``, which holds the local rectangle ``box`` (the whole local tensor when None); None when
        the rectangle is all padding."""
        starts, sizes = box if box is not None else ((0,) * tensor.dim(), tuple(tensor.shape))
        view = tensor
        for d, (s, n, e) in enumerate(zip(starts, sizes, self.extent)):
            keep = max(0, min(n, e - s))
            if keep == 0:
                return None
            if keep < n:
                view = view.narrow(d, 0, keep)
        offsets = tuple(o + s for o, s in zip(self.offsets, starts))
        return Piece(key, self.global_shape, offsets, view)


def tied_embeddings(core: nn.Module) -> bool:
    """Whether the model ties its output head to the token embedding (a Transformer's ``cfg``, or the
    ``tie_embeddings`` flag a pipeline's rank module carries)."""
    flag = getattr(core, "tie_embeddings", None)
    if flag is None:
        flag = getattr(getattr(core, "cfg", None), "tie_embeddings", False)
    return bool(flag)


class Placer:
    """Placements of the local parameters of ``core`` (the unwrapped model this rank holds)."""

    def __init__(self, core: nn.Module):
        self.core = core
        self.tied = tied_embeddings(core)
        # module path of each expert-parallel MoE layer → global index of its experts[0]
        self.expert_offsets = {name: m.expert_offset for name, m in core.named_modules()
                               if isinstance(m, ExpertParallelMoE)}

    def canonical_name(self, local_name: str) -> str:
        """The single-process name of a local parameter name."""
        if self.tied and local_name == "output.weight" and getattr(self.core, "tok_embeddings", None) is None:
            return "tok_embeddings.weight"  # a pipeline's last stage: its copy of the tied embedding
        for path, offset in self.expert_offsets.items():
            head = f"{path}.experts."
            if local_name.startswith(head):
                index, _, rest = local_name[len(head):].partition(".")
                return f"{head}{offset + int(index)}.{rest}"
        return local_name

    def place(self, local_name: str, local_shape: tuple[int, ...] | torch.Size) -> Placement:
        """The placement of the local parameter ``local_name`` of shape ``local_shape``."""
        shape = tuple(local_shape)
        path, _, attr = local_name.rpartition(".")
        module = self.core.get_submodule(path) if path else self.core
        name = self.canonical_name(local_name)
        if callable(getattr(module, "region", None)) and attr in ("weight", "bias"):
            global_shape, offsets = module.region(shape)  # a rectangle of the single-process tensor
            return Placement(name, tuple(global_shape), tuple(offsets), shape)
        split = _split_of(module, attr, shape)
        if split is None:
            param = module._parameters.get(attr)
            if param is not None and is_sharded(param):
                raise ValueError(f"{local_name} is sharded by a {type(module).__name__}, whose placement in the "
                                 "single-process model is not known to tessera.checkpoint")
            return Placement(name, shape, (0,) * len(shape), shape)
        dim, start, full = split
        global_shape = shape[:dim] + (full,) + shape[dim + 1:]
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        extent = tuple(max(0, min(n, full - start)) if d == dim else n for d, n in enumerate(shape))
        return Placement(name, global_shape, offsets, extent)


def _split_of(module: nn.Module, attr: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(split dimension, this rank's start along it, single-process size) of a tensor-parallel parameter,
    or None for a whole one. The local size along the split dimension is ``shape[dim]``."""
    if isinstance(module, ColumnParallelLinear) and attr in ("weight", "bias"):  # rows [r·O/N, (r+1)·O/N)
        return 0, module.group.rank * shape[0], module.out_features
    if isinstance(module, RowParallelLinear) and attr == "weight":  # columns [r·I/N, (r+1)·I/N)
        return 1, module.group.rank * shape[1], module.in_features
    if isinstance(module, VocabParallelEmbedding) and attr == "weight":  # rows [r·Vp/N, …) cut at V
        return 0, module.vocab_start, module.num_embeddings
    return None


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, Box]]:
    """The flattened range ``[a, b)`` of a C-contiguous tensor of ``shape`` as rectangles:
    ``(flat start, (offsets, sizes))`` each, in order. Every rectangle is itself a contiguous flat range
    (leading indices fixed, one dimension a range, the rest whole), so ``flat[start:start+numel].view(sizes)``
    is its data. At most 2·(ndim−1)+1 rectangles."""
    if a >= b:
        return []
    if not shape:
        return [(0, ((), ()))]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = a // inner, (b - 1) // inner
    if first == last and (a % inner or b - first * inner < inner):  # inside one row: recurse below it
        return [(first * inner + s, ((first, *o), (1, *n)))
                for s, (o, n) in flat_boxes(shape[1:], a - first * inner, b - first * inner)]
    out = []
    row = first
    if a % inner:  # the partial first row
        out += flat_boxes(shape, a, (first + 1) * inner)
        row = first + 1
    end = b // inner  # rows [row, end) are whole
    if end > row:
        out.append((row * inner, ((row, *(0,) * (len(shape) - 1)), (end - row, *shape[1:]))))
    if b % inner:  # the partial last row
        out += flat_boxes(shape, end * inner, b)
    return out
