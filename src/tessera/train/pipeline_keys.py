"""What a pipeline stage's MoE routers are told before each compute action: the micro-batch's rows (for the
training noise) and which of its tokens are padding, as ``tessera.train.step`` tells an unpipelined model.

Every pipeline rank holds the step's micro-batches, inputs and targets (``PipelineExecutor``), so every
stage, first, middle or last, marks its padding from the micro-batch's own targets and keys its noise by
the micro-batch's rows: stage s of micro-batch j draws what one process draws for those rows.

Rows: the rank's batch of the step starts at the run's sample ``first`` (``WindowSampler`` order) and is
cut into m micro-batches of b rows, so micro-batch j < m starts at ``first + j·b``; a look-ahead
micro-batch (``pipeline.flush = false``: the executor numbers the next step's m..2m-1) starts at
``first + step_rows + (j - m)·b``, the next step's rows.

Backward: a recomputed forward (``pipeline.recompute``, activation checkpointing) reads the routers' key
and padding when autograd reruns it, inside the B action, after other micro-batches' forwards have
re-keyed the layers. So before a B the stage's layers get back the very keys its F used (the
``TokenKey`` objects, which the stage's forward completed with the rows' positions, zig-zag ones under
cp), and its padding again.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.models.moe import MoELayers, key_tokens, mark_padding
from tessera.models.moe_tokens import TokenKey
from tessera.train.step import counted_targets


class StageKeys:
    """``before_compute`` of a pipeline executor over ``stages`` ({virtual stage: module}, prepared: their
    MoE layers are found once, here); stages without MoE layers are left alone."""

    def __init__(self, stages: dict[int, nn.Module]):
        found = {s: MoELayers(m) for s, m in stages.items()}
        self.moe = {s: layers for s, layers in found.items() if layers}  # {stage: its MoE layers}
        self.rows: tuple[int, int, int] | None = None  # (seed, first row, rows per step); None: no key
        self.m = 1  # micro-batches of this step
        self._used: dict[tuple[int, int], list[TokenKey | None]] = {}  # (stage, first row) -> F's keys

    def begin(self, rows: tuple[int, int, int] | None, n_microbatches: int) -> None:
        """A step (or an evaluation, ``rows`` None) starts: its rows and micro-batch count."""
        self.rows, self.m = rows, n_microbatches

    def end(self) -> None:
        """Forget the marks: later forwards outside the executor are not these rows (the keys of
        in-flight look-ahead micro-batches stay kept for their backward in the next step)."""
        self.rows = None
        for layers in self.moe.values():
            key_tokens(layers, None)
            mark_padding(layers, None)

    def __call__(self, kind: str, stage: int, mb: int, micro: tuple[Any, Any]) -> None:
        layers = self.moe.get(stage)
        if layers is None:
            return
        x_BS, y_BS = micro
        mark_padding(layers, counted_targets(y_BS))
        if self.rows is None:
            key_tokens(layers, None)
            return
        seed, first, step_rows = self.rows
        row = first + (mb // self.m) * step_rows + (mb % self.m) * x_BS.shape[0]
        if kind == "F":
            key_tokens(layers, seed, row)
            self._used[(stage, row)] = [layer.token_key for layer in layers]
            return
        keys = self._used.pop((stage, row), None)
        if keys is None:  # no forward of these rows kept its keys (cannot happen in a schedule): fresh ones
            key_tokens(layers, seed, row)
            return
        for layer, key in zip(layers, keys):
            layer.token_key = key
