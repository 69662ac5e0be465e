"""The mixture-of-experts layer's settings: the ``[moe]`` config section and the checks that need the model
and the parallel layout, and each expert's capacity (defined in :mod:`tessera.models.moe`'s docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.errors import ConfigError

NOISY_GATE_POLICIES = ("none", "jitter", "rsample")


@dataclass
class MoEConfig:
    """Router and MoE-layer knobs (the ``[moe]`` config section)."""

    top_k: int = 2  # experts each token is sent to (1 = Switch, 2 = GShard)
    capacity_factor: float = 1.25  # training capacity: slots per expert = factor · k · T / E
    eval_capacity_factor: float = 2.0  # the same in eval mode
    min_capacity: int = 4  # lower bound on slots per expert (small groups drop too much otherwise)
    drop_tokens: bool = True  # enforce capacity; False: no capacity, nothing is ever dropped
    # "none", "jitter" (scale the router input) or "rsample" (training only: the k experts are SAMPLED
    # from p without replacement, Gumbel-top-k). rsample keeps load balanced while the router's inputs are
    # still nearly alike (early training: deterministic top-k then sends a whole batch to the same k
    # experts); see docs/MOE.md "Load balancing on the default corpus".
    noisy_gate_policy: str = "none"
    jitter_eps: float = 1e-2  # jitter multiplies the router input by U(1-eps, 1+eps)
    normalize_top_k: bool = True  # renormalise the k chosen gates to sum to 1 (k > 1)
    use_residual: bool = False  # residual MoE: a dense MLP mixed with the experts (DeepSpeed)
    num_shared_experts: int = 0  # always-on experts every token goes through (added to the output)
    aux_loss_coef: float = 1e-2  # weight of the load-balancing loss
    z_loss_coef: float = 1e-3  # weight of the router z-loss

    def validate(self) -> MoEConfig:
        if self.top_k < 1:
            raise ConfigError(f"moe.top_k must be at least 1, got {self.top_k}.")
        if not (self.capacity_factor > 0 and self.eval_capacity_factor > 0):
            raise ConfigError("moe.capacity_factor and moe.eval_capacity_factor must be positive.")
        if self.min_capacity < 0 or self.num_shared_experts < 0:
            raise ConfigError("moe.min_capacity and moe.num_shared_experts must not be negative.")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ConfigError(f"moe.noisy_gate_policy must be one of {', '.join(NOISY_GATE_POLICIES)}, "
                              f"got {self.noisy_gate_policy!r}.")
        if not 0 <= self.jitter_eps < 1:
            raise ConfigError(f"moe.jitter_eps must be in [0, 1), got {self.jitter_eps}.")
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ConfigError("moe.aux_loss_coef and moe.z_loss_coef must not be negative.")
        return self


def validate_moe(moe: MoEConfig, num_experts: int, ep: int = 1) -> None:
    """Checks that need the model and the parallel layout; raises ConfigError with one sentence."""
    moe.validate()
    if num_experts <= 0:
        if ep > 1:
            raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model; set model.num_experts "
                              f"(or use --model.preset=moe-small).")
        return
    if moe.top_k > num_experts:
        raise ConfigError(f"moe.top_k={moe.top_k} exceeds the number of experts {num_experts}.")
    if num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the number of experts {num_experts} so every "
                          f"expert-parallel rank holds the same number of experts.")


def expert_capacity(tokens: int, num_experts: int, top_k: int, factor: float, min_capacity: int) -> int:
    """Slots per expert for a routing group of ``tokens`` tokens (see module doc)."""
    return min(tokens, max(min_capacity, math.ceil(factor * top_k * tokens / num_experts)))
