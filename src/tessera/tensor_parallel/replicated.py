"""Modules kept whole on every tensor-parallel rank inside a tp-split model (the MoE feed-forward).

A mixture-of-experts feed-forward is not split over tp: its router and experts are replicated, every tp
rank runs it on the same tokens, and its parameter gradients come out equal on every tp rank (the
global norm counts them once). Without sequence parallelism its input is the replicated residual
stream and nothing is needed. Under SP the stream is split along the sequence, so the layer is wrapped:

    forward:  all-gather the input along the sequence ([B, S/N, D] → [B, S, D]), run on all S tokens,
              keep this rank's slice of the output ([B, S, D] → [B, S/N, D])
    backward: all-gather of the output gradient; this rank's slice of the input gradient

so routing groups (and capacity, aux and z losses) are the same S-token micro-batches as in one process.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup


def whole_sequence_hooks(module: nn.Module, group: CommGroup) -> None:
    """Run ``module`` on the full sequence under SP (see the module doc); forward hooks, in place."""

    def enter(mod, args):
        return (comm.gather_from(args[0], group, dim=1), *args[1:])

    def leave(mod, args, out):
        return comm.scatter_to(out, group, dim=1)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def plan_without(plan: dict[str, str], model: nn.Module, skip: set[str]) -> dict[str, str]:
    """``plan`` with the ``layers.*.feed_forward`` entries spelled out per block, leaving out the blocks
    named in ``skip`` (e.g. ``{"layers.1.feed_forward"}``, whose feed-forward stays whole)."""
    ffn = {k: v for k, v in plan.items() if k.startswith("layers.*.feed_forward")}
    out = {k: v for k, v in plan.items() if k not in ffn}
    for name, _ in model.named_modules():
        if fnmatch.fnmatchcase(name, "layers.*.feed_forward") and name not in skip:
            prefix = name[: -len("feed_forward")]
            out.update({prefix + k[len("layers.*."):]: v for k, v in ffn.items()})
    return out
