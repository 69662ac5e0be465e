"""Mixture of experts on one device: the top-k router and the MoE feed-forward that replaces the MLP.

Single-device only (never imports torch.distributed); the expert-parallel layer in ``tessera.moe``
subclasses :class:`MoEFeedForward` and overrides only :meth:`MoEFeedForward.run_experts`.

Definitions (T tokens in one routing group = one micro-batch on one data-parallel rank, E experts,
k = top_k):

- Router probabilities ``p = softmax(x W_g)`` in float32. Each token picks the k experts with the
  largest score; ties go to the LOWER expert index (a stable sort), so routing is deterministic.
  Gates are the chosen probabilities, renormalised to sum to 1 when k > 1 (``normalize_top_k``).
  Training-only noise: "jitter" multiplies the input by U(1-eps, 1+eps); "rsample" adds Gumbel noise
  to the scores (not to p), so the k experts are drawn from p without replacement.
- Capacity per expert ``C = min(T, max(min_capacity, ceil(capacity_factor · k · T / E)))``. Slots
  are filled choice-major (every token's first choice before any second choice, GShard), in token
  order within a choice. An assignment past C is dropped: its expert output is zero, so the token
  passes through the block's residual connection unchanged. Dropped assignments are counted.
- Load-balancing loss (Switch eq. 4, GShard for k > 1) ``aux = E · Σ_e f_e · P_e`` with
  ``f_e`` = share of the T·k assignments routed to e (before dropping; no gradient) and
  ``P_e`` = mean router probability of e. Uniform routing gives aux = 1.
- Router z-loss (ST-MoE) ``z = mean_t logsumexp(logits_t)²``.
- Loss weighting: each group adds ``(aux_loss_coef·aux + z_loss_coef·z) · T`` to the micro-batch's
  summed token loss (see :func:`moe_loss_sum`) before the division by the global token count, so the
  aux term is a token-weighted mean over routing groups and N ranks equal one process.
- A routing group spread over devices (context parallelism: each rank holds chunks of every sequence)
  is decided as a whole: :meth:`Router.group_choices`, overridden by the strategy, returns the whole
  group's choices in token order (b·S + s), so capacity and slots are the one-device ones. Each device
  then keeps its own tokens' rows and adds its SHARE of aux and z (its tokens' part of the means over
  T), so the shares sum to the group's values, with no collective in autograd.

Legend: T tokens, D model dim, E experts, K top-k, N dispatched rows, F expert hidden dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.errors import ConfigError
from tessera.models.feed_forward import FeedForward

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


@dataclass
class Routing:
    """The router's decision for this device's T tokens of a routing group of ``tokens`` tokens (the same
    number unless the group is spread over devices; then aux and z are this device's shares)."""

    expert_TK: torch.Tensor  # long: chosen expert of each (token, choice)
    gate_TK: torch.Tensor  # float32 gate weight (differentiable; dropped ones are multiplied by 0)
    keep_TK: torch.Tensor  # bool: within capacity
    aux_loss: torch.Tensor  # 0-d, differentiable
    z_loss: torch.Tensor  # 0-d, differentiable
    kept_E: torch.Tensor  # long: assignments each expert computes
    routed_E: torch.Tensor  # long: assignments routed to each expert, before capacity dropping
    capacity: int  # slots per expert (T·k when drop_tokens is off)
    tokens: int  # tokens in the whole routing group

    @property
    def dropped(self) -> int:
        return int((~self.keep_TK).sum())


class Router(nn.Module):
    """Top-k softmax gate: ``gate`` is a bias-free Linear(D, E).

    :meth:`group_choices` is the one hook for a routing group spread over devices (see module doc).
    """

    def __init__(self, dim: int, num_experts: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = num_experts
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x_TD: torch.Tensor, batch: int = 1) -> Routing:
        """Route ``x_TD``: the T tokens of ``batch`` sequences, sequence-major ([B, S, D] flattened)."""
        cfg, n_exp, k = self.cfg, self.num_experts, self.cfg.top_k
        if self.training and cfg.noisy_gate_policy == "jitter":  # Switch: multiplicative input noise
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1 - cfg.jitter_eps, 1 + cfg.jitter_eps)
        logits_TE = self.gate(x_TD).float()
        probs_TE = logits_TE.softmax(dim=-1)
        scores_TE = logits_TE.detach()
        if self.training and cfg.noisy_gate_policy == "rsample":  # Gumbel noise on the choice only
            scores_TE = scores_TE - torch.empty_like(scores_TE).exponential_().log()
        # stable descending sort: equal scores keep index order, so ties go to the lower expert
        expert_TK = torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]
        gate_TK = probs_TE.gather(1, expert_TK)
        if k > 1 and cfg.normalize_top_k:
            gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True)
        group_GK, mine_T = self.group_choices(expert_TK, batch)  # G = tokens in the routing group
        tokens = group_GK.shape[0]
        factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        capacity = (expert_capacity(tokens, n_exp, k, factor, cfg.min_capacity) if cfg.drop_tokens
                    else tokens * k)
        keep_GK, routed_group_E = _fill_slots(group_GK, n_exp, capacity)
        keep_TK = keep_GK if mine_T is None else keep_GK[mine_T]
        share = x_TD.shape[0] / max(tokens, 1)  # this device's part of the group's means (1.0: all of it)
        f_E = routed_group_E.float() / max(tokens * k, 1)
        aux = n_exp * (f_E * probs_TE.mean(0)).sum() * share
        z = torch.logsumexp(logits_TE, dim=-1).pow(2).mean() * share
        kept_E = _count(expert_TK[keep_TK], n_exp)
        routed_E = routed_group_E if mine_T is None else _count(expert_TK, n_exp)
        return Routing(expert_TK, gate_TK, keep_TK, aux, z, kept_E, routed_E, capacity, tokens)

    def group_choices(self, expert_TK: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the routing group's choices [G, K] in token order, the rows of this device's T tokens in it).

        One device holds the whole group: (``expert_TK``, None). Context parallelism overrides this."""
        return expert_TK, None


def _count(expert: torch.Tensor, n_exp: int) -> torch.Tensor:
    """Assignments per expert [E] (long) among the expert indices ``expert`` (any shape)."""
    flat = expert.reshape(-1)
    return torch.zeros(n_exp, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _fill_slots(expert_TK: torch.Tensor, n_exp: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep_TK, routed_E): choice-major, token-order slot filling; routed_E counts before dropping."""
    keep = torch.empty_like(expert_TK, dtype=torch.bool)
    filled_E = torch.zeros(n_exp, dtype=torch.long, device=expert_TK.device)
    for j in range(expert_TK.shape[1]):
        onehot_TE = F.one_hot(expert_TK[:, j], n_exp)
        slot_T = ((onehot_TE.cumsum(0) - 1 + filled_E) * onehot_TE).sum(1)  # 0-based slot in its expert
        keep[:, j] = slot_T < capacity
        filled_E = filled_E + onehot_TE.sum(0)
    return keep, filled_E


def dispatch_plan(routing: Routing, n_exp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_N, slot_N, count_E): kept assignments sorted by expert (stable: token order within one).

    ``slot_N`` is the flat (token·k + choice) index each dispatched row is combined back into.
    """
    k = routing.expert_TK.shape[1]
    slot_all = torch.arange(routing.expert_TK.numel(), device=routing.expert_TK.device)
    keep = routing.keep_TK.reshape(-1)
    slot_kept = slot_all[keep]
    order = torch.sort(routing.expert_TK.reshape(-1)[keep], stable=True).indices
    slot_N = slot_kept[order]
    return slot_N // k, slot_N, routing.kept_E


def combine(y_ND: torch.Tensor, slot_N: torch.Tensor, gate_TK: torch.Tensor) -> torch.Tensor:
    """y_TD = Σ_k gate · expert output; dropped (token, choice) slots contribute zero."""
    t, k = gate_TK.shape
    buf = y_ND.new_zeros(t * k, y_ND.shape[-1]).index_copy(0, slot_N, y_ND)
    return (buf.view(t, k, -1) * gate_TK.to(y_ND.dtype).unsqueeze(-1)).sum(1)


def run_local_experts(experts: nn.ModuleList, x_ND: torch.Tensor, count_E: list[int]) -> torch.Tensor:
    """Rows grouped by expert (``count_E[e]`` rows for experts[e]) → outputs in the same order.

    Every expert runs, on zero rows if need be, so each expert gets a (zero) gradient every step
    whether or not tokens reached it: the optimizer then treats it the same on any number of ranks.
    """
    chunks = torch.split(x_ND, count_E)
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])


class MoEFeedForward(nn.Module):
    """Router + E SwiGLU experts (+ optional residual MLP and shared experts) in place of the MLP.

    Submodule names are a contract with expert parallelism: ``router``, ``experts`` (ModuleList),
    ``residual_mlp`` + ``residual_coef`` (use_residual), ``shared_experts`` (num_shared_experts > 0).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.num_experts = num_experts
        self.router = Router(dim, num_experts, cfg)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(num_experts))
        if cfg.use_residual:  # DeepSpeed residual MoE: out = c0·moe(x) + c1·mlp(x), c = softmax(Wx)
            self.residual_mlp = FeedForward(dim, hidden)
            self.residual_coef = nn.Linear(dim, 2, bias=False)
        if cfg.num_shared_experts:  # n shared experts fused into one MLP of n·F hidden units
            self.shared_experts = FeedForward(dim, hidden * cfg.num_shared_experts)
        self.pending_loss: torch.Tensor | None = None  # weighted aux + z of the last training forward
        self.stats = MoEStats.zeros(num_experts)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD, batch=x_BSD.shape[0] if x_BSD.dim() == 3 else 1)
        y_TD = self.run_experts(x_TD, routing)
        self._account(routing)
        if self.cfg.use_residual:
            coef_T2 = self.residual_coef(x_TD).softmax(dim=-1)
            y_TD = y_TD * coef_T2[:, :1] + self.residual_mlp(x_TD) * coef_T2[:, 1:]
        if self.cfg.num_shared_experts:
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view_as(x_BSD)

    def run_experts(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """All experts on this device: gather rows by expert, run, scatter back weighted by the gates."""
        token_N, slot_N, count_E = dispatch_plan(routing, self.num_experts)
        y_ND = run_local_experts(self.experts, x_TD[token_N], count_E.tolist())
        return combine(y_ND, slot_N, routing.gate_TK)

    def _account(self, routing: Routing) -> None:
        """Training forwards only: keep the routing loss of THIS forward (replacing any earlier one, so a
        caller that never collects it holds no old autograd graph) and count the routing. The loss is
        weighted by the whole group's T: a device holding part of the group adds its share of it.
        A forward that autograd runs inside backward (activation checkpointing's recomputation) repeats
        one already counted and collected, so it is skipped."""
        if self.training and torch._C._current_graph_task_id() == -1:  # -1: not inside a backward
            self.pending_loss = (self.cfg.aux_loss_coef * routing.aux_loss
                                 + self.cfg.z_loss_coef * routing.z_loss) * routing.tokens
            self.stats.add(routing)


@dataclass
class MoEStats:
    """Per-layer routing counters accumulated over forwards until read (float64 so sums stay exact).

    They live on the device the routing ran on and are added to there, so a forward never waits for the
    device (no ``.item()`` / ``.cpu()``); the host reads them once per step, after the metrics all-reduce.
    Every counter is this device's share (its tokens; its share of aux·T and z·T), so summing them over
    every rank that holds different tokens gives the job's counts.
    """

    values: torch.Tensor  # [2E + 5]: kept per expert, routed per expert, dropped, assignments, tokens, aux·T, z·T

    @classmethod
    def zeros(cls, n_exp: int) -> MoEStats:
        # on the CPU even inside a meta-device build (not a parameter: nothing would materialise it); the
        # first forward moves it to its device (``on``)
        return cls(torch.zeros(2 * n_exp + 5, dtype=torch.float64, device="cpu"))

    def on(self, device: torch.device) -> torch.Tensor:
        """The counters, moved to ``device`` first if they are elsewhere (once: the first forward there)."""
        if self.values.device != device:
            self.values = self.values.to(device)
        return self.values

    def add(self, routing: Routing) -> None:
        values, n_exp = self.on(routing.kept_E.device), routing.kept_E.numel()
        values[:n_exp].add_(routing.kept_E)
        values[n_exp : 2 * n_exp].add_(routing.routed_E)
        values[2 * n_exp].add_((~routing.keep_TK).sum())
        values[2 * n_exp + 1].add_(routing.expert_TK.numel())  # Python ints: kernel arguments, no copy
        values[2 * n_exp + 2].add_(routing.expert_TK.shape[0])
        values[2 * n_exp + 3].add_(routing.aux_loss.detach().double() * routing.tokens)
        values[2 * n_exp + 4].add_(routing.z_loss.detach().double() * routing.tokens)

    def reset(self) -> None:
        self.values.zero_()


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """Every MoE feed-forward in ``model`` (any wrapper around it is fine), in module order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_loss_sum(model: nn.Module) -> torch.Tensor | float:
    """The routing loss of the last training forward, as a SUM to add to the summed token loss.

    Call once per micro-batch, right after ``model(x)``: ``(ce_sum + moe_loss_sum(model)) / global_tokens``
    (a second forward before the call replaces the first one's term). Returns 0.0 for a dense model, in
    eval mode, or when already collected.
    """
    total: torch.Tensor | float = 0.0
    for layer in moe_layers(model):
        if layer.pending_loss is not None:
            total = total + layer.pending_loss
            layer.pending_loss = None
    return total


def format_stats(values_LX: torch.Tensor, n_exp: int) -> dict:
    """Metrics from summed counters [layers, 2E + 5] (see MoEStats): plain floats and lists."""
    kept_LE, routed_LE = values_LX[:, :n_exp], values_LX[:, n_exp : 2 * n_exp]
    dropped, assigned, tokens, aux_t, z_t = values_LX[:, 2 * n_exp :].unbind(1)
    load_LE = routed_LE / assigned.clamp(min=1).unsqueeze(1) * n_exp  # 1.0 = perfectly balanced
    return {
        "moe_tokens_per_expert": kept_LE.sum(0).tolist(),  # computed assignments, summed over MoE layers
        "moe_load_per_layer": load_LE.tolist(),  # routed (pre-capacity) load / uniform share, per layer
        "moe_dropped_frac": float(dropped.sum() / assigned.sum().clamp(min=1)),
        "moe_aux_loss": float((aux_t / tokens.clamp(min=1)).mean()),
        "moe_z_loss": float((z_t / tokens.clamp(min=1)).mean()),
    }


def collect_local_stats(model: nn.Module) -> torch.Tensor | None:
    """Counters of every MoE layer stacked [layers, 2E + 5], then reset; None for a dense model.

    The result lives on the device the layers' training forwards ran on (the router's device), so it can
    go to a collective of that device's group as it is.
    """
    layers = moe_layers(model)
    if not layers:
        return None
    device = layers[0].stats.values.device
    out = torch.stack([layer.stats.on(device) for layer in layers])
    for layer in layers:
        layer.stats.reset()
    return out
