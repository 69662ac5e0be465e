"""Context-parallelise a model in place: swap every attention core for a distributed one, give the
model the absolute positions of the tokens each rank holds, and make every mixture-of-experts router
decide the whole micro-batch as one routing group (``moe_routing.py``).

What the caller must do besides (see docs/CONTEXT_PARALLEL.md): feed each cp rank its zig-zag shard of
tokens AND labels (`shard_sequence`), count tokens and reduce gradients over the ``dp_cp`` group.
"""

from __future__ import annotations

from torch import nn

from tessera.comm.group import CommGroup
from tessera.context_parallel.config import ContextParallelConfig
from tessera.context_parallel.layout import zigzag_positions
from tessera.context_parallel.moe_routing import route_over_context
from tessera.context_parallel.ring_attention import RingAttention
from tessera.context_parallel.ring_self_attention import RingSelfAttention
from tessera.context_parallel.ulysses import UlyssesAttention
from tessera.errors import ConfigError


def make_core(method: str, group: CommGroup, dense_core: nn.Module) -> nn.Module:
    """The distributed core for ``method`` ("ring" | "ulysses" | "ring_self_attention")."""
    if method == "ring":
        return RingAttention(group)
    if method == "ulysses":
        return UlyssesAttention(group, dense_core)
    if method == "ring_self_attention":
        return RingSelfAttention(group)
    raise ConfigError(f"Unknown context-parallel method {method!r}.")


def _position_hook(cp: CommGroup):
    """Forward pre-hook: tokens [B, L] on a cp rank are the zig-zag shard of an [B, cp·L] sequence."""

    def hook(module, args, kwargs):
        if kwargs.get("positions") is not None:
            return None
        local = args[0].shape[1]
        if local % 2:
            raise ValueError(
                f"A context-parallel rank got {local} tokens; it needs an even number (two equal "
                "chunks), so the sequence length must be divisible by 2·cp."
            )
        positions = zigzag_positions(local * cp.size, cp.rank, cp.size, device=args[0].device)
        return args, {**kwargs, "positions": positions}

    return hook


def apply_context_parallel(model: nn.Module, cp: CommGroup, cfg: ContextParallelConfig) -> nn.Module:
    """In place: every module with a ``core_attention`` gets the ``cfg.method`` core over ``cp``,
    ``model`` (a `Transformer`) gets a pre-hook passing ``positions`` of this rank's tokens, and every
    MoE router routes over ``cp`` (capacity, slots and auxiliary losses of the whole micro-batch).

    A cp group of size 1 leaves the model untouched. Returns ``model``.
    """
    cfg.validate()
    if cp.size == 1:
        return model
    attentions = [m for m in model.modules() if hasattr(m, "core_attention")]
    if not attentions:
        raise ConfigError("Context parallelism found no attention module with a core_attention to replace.")
    for attn in attentions:
        # per-rank heads (after any tensor parallelism); sequence length is checked per batch
        cfg.check_shapes(cp.size, None, attn.n_heads, attn.n_kv_heads,
                         getattr(attn.core_attention, "dropout", 0.0))
        attn.core_attention = make_core(cfg.method, cp, attn.core_attention)
    route_over_context(model, cp)
    model.register_forward_pre_hook(_position_hook(cp), with_kwargs=True)
    return model
