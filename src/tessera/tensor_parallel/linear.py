"""Megatron 1D tensor-parallel linear layers: the weight split by output rows or by input columns.

Legend: B batch, S sequence, I in features, O out features, N = tp group size. Each layer is built from
a dense ``nn.Linear`` (``from_linear``) so every rank slices the same full weight and the sharded model
starts equal to the dense one; parameters keep the dense names (``weight``, ``bias``). A dense layer on the
meta device gives a meta layer whose slices record their origin (``tessera.models.init.assign``): nothing
is copied or allocated until the model is materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.lora import has_adapter, lora_delta
from tessera.models.init import assign
from tessera.tensor_parallel.adapters import attach_adapter
from tessera.tensor_parallel.regions import gather_seq, reduce_scatter_seq

INPUT_MODES = ("replicated", "parallel", "sequence")
OUTPUT_MODES = ("reduce", "reduce_scatter", "partial")


def mark_sharded(param: nn.Parameter) -> nn.Parameter:
    """Tag a parameter whose ranks hold different slices (gradient clipping sums their norms over tp)."""
    param.tensor_parallel_sharded = True
    return param


def is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_parallel_sharded", False))


def _assign_rows(dest: torch.Tensor, weight: torch.Tensor, group: CommGroup,
                 padded_rows: int | None = None) -> torch.Tensor:
    """dest [O/N, ...] ← this rank's block of ``weight``'s rows; rows past the dense ones (vocabulary
    padding) are zero. On the meta device dest only records where its values come from
    (``tessera.models.init.assign``), so no rank ever copies or allocates the whole weight."""
    rows = padded_rows or weight.shape[0]
    if rows % group.size:
        raise ValueError(f"{rows} output features cannot be split evenly over {group.size} tp ranks")
    per = rows // group.size
    lo = group.rank * per
    n = max(0, min(per, weight.shape[0] - lo))  # dense rows in this block, the rest is padding
    return assign(dest, weight[lo : lo + n], rows=None if n == per else n)


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ with A [O, I] split by output rows: rank r holds A_r [O/N, I] and computes y_r [.., O/N].

    ``input_mode``:
      "replicated": x is the same on every rank — fwd identity, bwd all-reduce of dx (Megatron's f).
      "parallel":   the caller already entered the region (one f shared by several layers) — no comm.
      "sequence":   x is split along the sequence (SP) — fwd all-gather of x, bwd reduce-scatter of dx.
    ``gather_output``: fwd all-gather of y along features into [.., O], bwd keeps this rank's slice;
    otherwise y stays split [.., O/N] (the input a RowParallelLinear expects).

    LoRA (a dense layer with an adapter): A [r, I] whole, B [O/N, r] this rank's rows, so the adapter's
    output y_r += scale · (x Aᵀ) B_rᵀ is split like y and needs no forward communication; x is the input
    the weight sees (the gathered sequence under SP). Each rank's dA covers only its B rows: A enters
    through ``copy_to``, so bwd all-reduces dA [r, I] over tp (as SP's norm weights).
    """

    def __init__(self, in_features: int, out_features: int, group: CommGroup, bias: bool = False,
                 input_mode: str = "replicated", gather_output: bool = False, padded_out: int | None = None,
                 device: torch.device | None = None):
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {input_mode!r}")
        self.group, self.input_mode, self.gather_output = group, input_mode, gather_output
        self.in_features, self.out_features = in_features, out_features
        self.out_padded = padded_out or out_features  # O rounded up to a multiple of N (vocab padding)
        per = self.out_padded // group.size
        self.weight = mark_sharded(nn.Parameter(torch.empty(per, in_features, device=device)))
        self.bias = mark_sharded(nn.Parameter(torch.zeros(per, device=device))) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: CommGroup, padded_out: int | None = None, **kw):
        """This rank's rows of ``linear`` (on its device; on the meta device only their origin)."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    padded_out=padded_out, device=linear.weight.device, **kw)
        with torch.no_grad():
            _assign_rows(layer.weight, linear.weight, group, padded_out)
            if linear.bias is not None:
                _assign_rows(layer.bias, linear.bias, group, padded_out)
        if has_adapter(linear):
            if layer.out_padded != layer.out_features:
                raise ValueError("a LoRA adapter cannot sit on a layer whose outputs are padded for tp")
            per = layer.out_padded // group.size
            b_rows = linear.lora_B.weight[group.rank * per : (group.rank + 1) * per]  # a view: [O/N, r]
            attach_adapter(layer, linear, linear.lora_A.weight, (0, 0), False, b_rows, (group.rank * per, 0), True)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_mode == "replicated":
            x = comm.copy_to(x, self.group)
        elif self.input_mode == "sequence":
            x = gather_seq(x, self.group, dim=1)
        y = F.linear(x, self.weight, self.bias)  # [.., O/N]
        if has_adapter(self):
            y = y + lora_delta(self, x, a=comm.copy_to(self.lora_A.weight, self.group))  # [.., O/N]
        return comm.gather_from(y, self.group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}/{self.group.size} ranks, "
                f"input={self.input_mode}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = x Aᵀ with A [O, I] split by input columns: rank r holds A_r [O, I/N]; y = Σ_r x_r A_rᵀ.

    ``input_is_parallel``: x is already split [.., I/N] (a ColumnParallelLinear's output); otherwise the
    full x is sliced here (fwd: own slice, bwd: all-gather of dx).
    ``output_mode``:
      "reduce":         fwd all-reduce of the partial sums, bwd identity (Megatron's g).
      "reduce_scatter": fwd reduce-scatter along the sequence (SP), bwd all-gather of dy.
      "partial":        no comm; the caller reduces.
    The bias, replicated, is added once after the reduction.

    LoRA (a dense layer with an adapter): A_r [r, I/N] this rank's columns, B [O, r] whole; the adapter's
    partial output scale · (x_r A_rᵀ) Bᵀ is added to the partial sum before the reduction, so it rides
    the layer's own all-reduce / reduce-scatter (Σ_r x_r A_rᵀ = x Aᵀ). Each rank's dB covers only its
    partial h = x_r A_rᵀ: B enters through ``copy_to``, so bwd all-reduces dB [O, r] over tp.
    """

    def __init__(self, in_features: int, out_features: int, group: CommGroup, bias: bool = False,
                 input_is_parallel: bool = True, output_mode: str = "reduce", device: torch.device | None = None):
        super().__init__()
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be one of {OUTPUT_MODES}, got {output_mode!r}")
        if in_features % group.size:
            raise ValueError(f"{in_features} input features cannot be split evenly over {group.size} tp ranks")
        self.group, self.input_is_parallel, self.output_mode = group, input_is_parallel, output_mode
        self.in_features, self.out_features = in_features, out_features
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, in_features // group.size, device=device)))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: CommGroup, **kw):
        """This rank's columns of ``linear`` (on its device; on the meta device only their origin)."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, **kw)
        with torch.no_grad():
            assign(layer.weight, linear.weight.chunk(group.size, dim=1)[group.rank])
            if linear.bias is not None:
                assign(layer.bias, linear.bias)
        if has_adapter(linear):
            cols = linear.in_features // group.size
            a_cols = linear.lora_A.weight.chunk(group.size, dim=1)[group.rank]  # a view: [r, I/N]
            attach_adapter(layer, linear, a_cols, (0, group.rank * cols), True, linear.lora_B.weight, (0, 0), False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to(x, self.group, dim=-1)
        y = F.linear(x, self.weight)  # partial sum [.., O]
        if has_adapter(self):
            y = y + lora_delta(self, x, b=comm.copy_to(self.lora_B.weight, self.group))  # partial too
        if self.output_mode == "reduce":
            y = comm.reduce_from(y, self.group)
        elif self.output_mode == "reduce_scatter":
            y = reduce_scatter_seq(y, self.group, dim=1)
        if self.bias is not None and self.output_mode != "partial":  # "partial": the caller adds it once
            y = y + (comm.copy_to(self.bias, self.group) if self.output_mode == "reduce_scatter" else self.bias)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}/{self.group.size} ranks, out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}, output={self.output_mode}")
