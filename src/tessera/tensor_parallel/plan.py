"""Apply Megatron 1D tensor parallelism (+ sequence parallelism) to the unmodified reference model.

A plan maps module names (fnmatch patterns over ``named_modules``) to a style; ``apply_tensor_parallel``
swaps or hooks those modules in place. Styles (N = tp size; "region" = where activations are split
over tp, by heads or by hidden units):

    "attention"        enter the region at the input (f = copy_to, or SP all-gather); keep H/N query and
                       K/N kv heads; attention-probability dropout on the split stream
    "mlp"              enter the region at the input (as above)
    "colwise"          ColumnParallelLinear inside the region (no communication of its own)
    "rowwise"          RowParallelLinear leaving the region (g = all-reduce, or SP reduce-scatter)
    "norm"             replicated; under SP it runs on 1/N of the sequence and all-reduces its weight grad
    "dropout"          replicated stream, or the split stream under SP (where activations are split)
    "vocab_embedding"  VocabParallelEmbedding (all-reduce, or SP reduce-scatter)
    "vocab_output"     VocabParallelHead: enters the region itself, returns vocab-split logits

Per transformer block and micro-batch this gives 2 all-reduces of B·S·D in forward and 2 in backward
(no SP), or 2 all-gathers + 2 reduce-scatters each way (SP).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.errors import ConfigError
from tessera.lora import has_adapter
from tessera.models.layers import rms_normalize
from tessera.tensor_parallel.adapters import frozen_names, refreeze
from tessera.tensor_parallel.config import TensorParallelConfig
from tessera.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from tessera.tensor_parallel.regions import gather_seq
from tessera.tensor_parallel.saved import RegatherOnBackward
from tessera.tensor_parallel.rng import TensorParallelDropout, TensorParallelRNG
from tessera.tensor_parallel.vocab import VocabParallelEmbedding, VocabParallelHead

STYLES = ("attention", "mlp", "colwise", "rowwise", "norm", "dropout", "vocab_embedding", "vocab_output")


def default_plan() -> dict[str, str]:
    """The plan for ``tessera.models.Transformer`` (its submodule names are the contract)."""
    return {
        "tok_embeddings": "vocab_embedding",
        "emb_dropout": "dropout",
        "layers.*.attention_norm": "norm",
        "layers.*.attention": "attention",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.attention.resid_dropout": "dropout",
        "layers.*.ffn_norm": "norm",
        "layers.*.feed_forward": "mlp",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "layers.*.resid_dropout": "dropout",
        "norm": "norm",
        "output": "vocab_output",
    }


class SequenceParallelRMSNorm(nn.Module):
    """RMSNorm on a sequence slice [B, S/N, D]. Fwd: no communication. Bwd: all-reduce of the weight's
    gradient (each rank saw only its tokens), via ``copy_to`` on the weight. Same math as RMSNorm."""

    rms_norm_kernel = "reference"  # as RMSNorm's: set after build by tessera.kernels.apply_kernels

    def __init__(self, weight: nn.Parameter, eps: float, group: CommGroup):
        super().__init__()
        self.weight, self.eps, self.group = weight, eps, group

    def forward(self, x_BsD: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x_BsD, self.eps, self.rms_norm_kernel) * comm.copy_to(self.weight, self.group)


def _region_entry(group: CommGroup, sequence_parallel: bool):
    """Forward pre-hook: replace the first input with its entry into the tp region (f or SP all-gather).

    Under SP the gathered tensor is saved for backward only as this rank's slice (``RegatherOnBackward``),
    so the region's inputs cost sbh/N like everything else; the hooks stay on until the forward hook."""

    def enter(module, args):
        x = args[0]
        if not sequence_parallel:
            return (comm.copy_to(x, group), *args[1:])
        full = gather_seq(x, group, dim=1).contiguous()
        if torch.is_grad_enabled():
            module._tp_saved = RegatherOnBackward(full, x, group, dim=1)
            module._tp_saved.context.__enter__()
        return (full, *args[1:])

    def leave(module, args, out):
        saved = getattr(module, "_tp_saved", None)
        if saved is not None:
            module._tp_saved = None
            saved.context.__exit__(None, None, None)

    return enter, leave


def _attention_rng_hooks(module: nn.Module, rng: TensorParallelRNG) -> None:
    """Run the attention core (SDPA dropout over split heads) on the split stream."""

    def enter(mod, args):
        mod._tp_rng_ctx = rng.split_region(args[0].device)
        mod._tp_rng_ctx.__enter__()

    def leave(mod, args, out):
        ctx, mod._tp_rng_ctx = mod._tp_rng_ctx, None
        ctx.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


class CheckpointedCore(nn.Module):
    """Selective recomputation (Korthikanti et al.): the attention core keeps only q, k, v for backward
    and recomputes softmax(QKᵀ)V there. The RNG streams are forked outside it, so recompute replays
    the same dropout mask (``checkpoint`` restores the RNG state it saw)."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core

    @property
    def dropout(self) -> float:
        return getattr(self.core, "dropout", 0.0)

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.core(*args)
        return checkpoint(self.core, *args, use_reentrant=False)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def _adapter_dropout(layer: nn.Module, rng: TensorParallelRNG, kind: str) -> nn.Module:
    """A LoRA adapter's input dropout on the stream of its input: the whole x of a column-parallel layer is
    the same on every tp rank ("replicated"), a row-parallel layer's x_r are different features ("split")."""
    p = getattr(getattr(layer, "lora_dropout", None), "p", 0.0) if has_adapter(layer) else 0.0
    if p > 0:
        layer.lora_dropout = TensorParallelDropout(p, rng, kind)
    return layer


def _apply_style(model, name, module, style, group, cfg, rng) -> None:
    sp, n = cfg.sequence_parallel, group.size
    if style in ("attention", "mlp"):
        enter, leave = _region_entry(group, sp)
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        if style == "attention":
            module.n_heads //= n
            module.n_kv_heads //= n
            core = getattr(module, "core_attention", module)  # the SDPA call, whose dropout is over split heads
            if cfg.recompute_core_attention and core is not module:
                core = module.core_attention = CheckpointedCore(core)
            if getattr(core, "dropout", 0.0):
                _attention_rng_hooks(core, rng)
    elif style == "colwise":
        _replace(model, name, _adapter_dropout(
            ColumnParallelLinear.from_linear(module, group, input_mode="parallel"), rng, "replicated"))
    elif style == "rowwise":
        mode = "reduce_scatter" if sp else "reduce"
        _replace(model, name, _adapter_dropout(
            RowParallelLinear.from_linear(module, group, output_mode=mode), rng, "split"))
    elif style == "norm":
        if sp:
            _replace(model, name, SequenceParallelRMSNorm(module.weight, module.eps, group))
    elif style == "dropout":
        _replace(model, name, TensorParallelDropout(module.p, rng, "split" if sp else "replicated"))
    elif style == "vocab_embedding":
        mode = "reduce_scatter" if sp else "reduce"
        _replace(model, name, VocabParallelEmbedding.from_embedding(module, group, output_mode=mode))
    elif style == "vocab_output":
        mode = "sequence" if sp else "replicated"
        _replace(model, name, VocabParallelHead.from_linear(module, group, input_mode=mode))
    else:
        raise ValueError(f"unknown tensor-parallel style {style!r} for module '{name}'; use one of {STYLES}")


def apply_tensor_parallel(model: nn.Module, group: CommGroup, cfg: TensorParallelConfig | None = None,
                          plan: dict[str, str] | None = None) -> nn.Module:
    """Shard ``model`` (every tp rank holds the same dense weights, or the same model on the meta device:
    then each layer only records where its slice's values come from, and ``tessera.models.init.materialize``
    allocates the slices alone) over ``group`` in place; return it.

    Afterwards ``model(tokens_BS)`` returns vocab-split logits [B, S, Vp/N]: use
    :class:`TensorParallelLoss` (or ``vocab_parallel_cross_entropy_sum``) as the loss.
    """
    cfg = cfg or TensorParallelConfig()
    cfg.validate(group.size, getattr(model, "cfg", None))
    if cfg.mode != "1d":
        raise ConfigError(
            f"apply_tensor_parallel is Megatron 1D; tensor_parallel.mode={cfg.mode} splits a whole Transformer "
            "with tessera.tensor_parallel.nd.apply_nd_tensor_parallel."
        )
    if group.size == 1:
        return model
    plan = plan if plan is not None else default_plan()
    rng = TensorParallelRNG(group, cfg.seed)
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    matched, frozen = set(), frozen_names(model)
    for name, module in list(model.named_modules()):
        for pattern, style in plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                _apply_style(model, name, module, style, group, cfg, rng)
                matched.add(pattern)
                break
    missing = sorted(set(plan) - matched)
    if missing:
        raise ValueError(f"tensor-parallel plan entries matched no module: {', '.join(missing)}")
    if (tied and isinstance(getattr(model, "output", None), VocabParallelHead)
            and getattr(model, "tok_embeddings", None) is not None):  # a last pipeline stage has no embedding
        model.output.weight = model.tok_embeddings.weight  # same rows on each rank: still one tensor
    refreeze(model, frozen)  # LoRA: the base weights stay frozen in their parallel layers
    model.tensor_parallel = (group, cfg)  # the group and config this model was split with, for callers
    return model
