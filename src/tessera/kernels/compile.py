"""``kernels.compile``: ``torch.compile`` of each transformer block's own computation, under every layout.

What is compiled: each block's *instance* ``forward`` is replaced by ``torch.compile`` of the forward it
had (``dynamic=False``: a run's micro-batches all have one shape). Module hooks run in ``nn.Module.__call__``,
around that forward, so they stay eager; that is how compiled blocks compose with every strategy:

- DDP / ZeRO-1/2 reduce from gradient hooks on the parameters (AccumulateGrad), which compiled graphs
  feed like eager ones; the wrapper is added after the blocks are compiled (compiling the DDP wrapper
  itself would compile nothing, pytorch#140416).
- ZeRO-3 gathers a block's parameters in its pre-forward hook and frees them in its post-forward hook:
  both run outside the compiled forward, which sees the gathered parameters as graph inputs.
- Activation checkpointing wraps the compiled forward (it is applied after this, in the one order of
  ``tessera.parallelize.parallelize_model_side``): the recomputation in backward runs the same compiled
  graph again.
- Tensor parallelism (1D / SP / 2D / 2.5D / 3D) and context parallelism issue their collectives inside
  autograd Functions and module hooks within the block; dynamo breaks the graph there and runs them
  eagerly, so the results are those of the eager block (fewer fusions).
- A pipeline stage holds blocks like a whole model (``tessera.train.pipeline_stage`` calls the same chain).
- Mixture of experts (one process or expert parallel): a routed feed-forward splits its tokens by per-expert
  counts known only at run time (``torch.split`` by counts, all-to-all splits), which dynamo would
  specialise on, one graph per count pattern until its recompile limit. In a block holding one, its other
  children (norms, attention) are compiled and the routed feed-forward with its all-to-alls runs eagerly.

Compilation is lazy: a block is traced at its first call, with whatever layers the later strategies put
into it. Train and eval, grad and no-grad, are one graph (set) each per block type, shared by all blocks of
that type; ``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` counts them.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.kernels.config import KernelsConfig
from tessera.models.moe import MoEFeedForward


def apply_compile(model: nn.Module, cfg: KernelsConfig | None) -> list[nn.Module]:
    """Compile, in place with ``cfg.compile_backend`` when ``cfg.compile``, the forward of each block of
    ``model`` (a Transformer or a pipeline stage: its ``layers``), or of a mixture-of-experts block's
    children other than its routed feed-forward. Returns the modules compiled (none when off). Call
    before activation checkpointing wraps the blocks."""
    if cfg is None or not cfg.compile:
        return []
    compiled = []
    for block in model.layers.values():
        if _holds_moe(block):
            compiled += [child for child in block.children()
                         if not _holds_moe(child) and any(True for _ in child.parameters())]
        else:
            compiled.append(block)
    for module in compiled:
        module.forward = torch.compile(module.forward, backend=cfg.compile_backend, dynamic=False)
    return compiled


def _holds_moe(module: nn.Module) -> bool:
    return any(isinstance(m, MoEFeedForward) for m in module.modules())
