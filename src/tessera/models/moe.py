"""Mixture of experts on one device: the top-k router and the MoE feed-forward that replaces the MLP.

Single-device only (never imports torch.distributed); the expert-parallel layer in ``tessera.moe``
subclasses :class:`MoEFeedForward` and overrides only :meth:`MoEFeedForward.run_experts`.

Definitions (T tokens in one routing group = one micro-batch on one data-parallel rank, E experts,
k = top_k):

- Router probabilities ``p = softmax(x W_g)`` in float32. Each token picks the k experts with the
  largest score; ties go to the LOWER expert index (a stable sort), so routing is deterministic.
  Gates are the chosen probabilities, renormalised to sum to 1 when k > 1 (``normalize_top_k``).
  Training-only noise: "jitter" multiplies the input by U(1-eps, 1+eps); "rsample" adds Gumbel noise
  to the scores (not to p), so the k experts are drawn from p without replacement. The numbers are a
  function of the token (run seed, layer, row, position: :mod:`tessera.models.moe_tokens`), so every
  layout draws the same ones for the same token.
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
- Padding (a row's tail of uncounted targets) is not a token of the group: it takes no slot and no part
  in T, aux, z or the counters (:mod:`tessera.models.moe_tokens`).

Legend: T tokens, D model dim, E experts, K top-k, N dispatched rows, F expert hidden dim.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.errors import ConfigError
from tessera.models.feed_forward import FeedForward
from tessera.models.moe_tokens import TokenKey, layer_index, real_tokens, route_padding_nowhere, token_uniform
from tessera.models.moe_config import (NOISY_GATE_POLICIES, MoEConfig, expert_capacity,  # noqa: F401 (re-exported)
                                       validate_moe)
from tessera.models.moe_stats import MoEStats, format_stats  # noqa: F401 (format_stats: re-exported)

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
    tokens: int  # real tokens in the whole routing group
    valid_T: torch.Tensor | None = None  # bool: real tokens (False: padding, routed nowhere); None: all

    @property
    def dropped_TK(self) -> torch.Tensor:
        """bool: real assignments dropped for capacity."""
        return ~self.keep_TK if self.valid_T is None else ~self.keep_TK & self.valid_T[:, None]

    @property
    def dropped(self) -> int:
        return int(self.dropped_TK.sum())


class Router(nn.Module):
    """Top-k softmax gate: ``gate`` is a bias-free Linear(D, E).

    :meth:`group_choices` is the one hook for a routing group spread over devices (see module doc).
    """

    def __init__(self, dim: int, num_experts: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = num_experts
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x_TD: torch.Tensor, batch: int = 1, key: TokenKey | None = None,
                counted_T: torch.Tensor | None = None) -> Routing:
        """Route ``x_TD``: the T tokens of ``batch`` sequences, sequence-major ([B, S, D] flattened).
        ``key`` names the tokens for the training noise (None: torch's random state draws it).
        ``counted_T`` (bool [T]: the token's target counts; None: all do) marks padding, a row's tail of
        uncounted targets (``moe_tokens.real_tokens``): it chooses no expert, so it takes no slot and has no part in
        the capacity, aux, z or counters, as if the group held only its real tokens. It may lie on the host
        (the trainer's, from the host's targets): then the group's real tokens are counted there."""
        cfg, n_exp, k = self.cfg, self.num_experts, self.cfg.top_k
        if self.training and cfg.noisy_gate_policy == "jitter":  # Switch: multiplicative input noise
            u_TD = _uniform(key, batch, x_TD.shape, x_TD.device)
            x_TD = x_TD * (1 - cfg.jitter_eps + 2 * cfg.jitter_eps * u_TD).to(x_TD.dtype)
        logits_TE = self.gate(x_TD).float()
        probs_TE = logits_TE.softmax(dim=-1)
        scores_TE = logits_TE.detach()
        if self.training and cfg.noisy_gate_policy == "rsample":  # Gumbel noise on the choice only
            scores_TE = scores_TE - (-_uniform(key, batch, scores_TE.shape, scores_TE.device).log()).log()
        # stable descending sort: equal scores keep index order, so ties go to the lower expert
        expert_TK = torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]
        gate_TK = probs_TE.gather(1, expert_TK)
        if k > 1 and cfg.normalize_top_k:
            gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True)
        if counted_T is not None:  # uncounted targets ride along with the choices, shifted by n_exp + 1
            uncounted_T = counted_T.to(x_TD.device, non_blocking=True).logical_not()  # host → device: no wait
            expert_TK = expert_TK + (n_exp + 1) * uncounted_T.long()[:, None]
        group_GK, mine_T = self.group_choices(expert_TK, batch)  # G = tokens in the routing group
        valid_T = None
        if counted_T is not None:  # padding is a tail of the WHOLE row: decided over the group
            group_GK, real_G = route_padding_nowhere(group_GK, batch, n_exp)
            expert_TK, valid_T = (group_GK, real_G) if mine_T is None else (group_GK[mine_T], real_G[mine_T])
        tokens = group_GK.shape[0] if valid_T is None else _real_count(real_G, counted_T, batch, mine_T is None)
        factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        capacity = (expert_capacity(tokens, n_exp, k, factor, cfg.min_capacity) if cfg.drop_tokens
                    else tokens * k)
        keep_GK, routed_group_E = _fill_slots(group_GK, n_exp, capacity)
        keep_TK = keep_GK if mine_T is None else keep_GK[mine_T]
        share = x_TD.shape[0] / max(tokens, 1)  # this device's part of the group's means (1.0: all of it)
        f_E = routed_group_E.float() / max(tokens * k, 1)
        z2_T = torch.logsumexp(logits_TE, dim=-1).pow(2)
        if valid_T is None:
            p_E, z2 = probs_TE.mean(0), z2_T.mean()
        else:  # means over this device's real tokens only
            mine = valid_T.sum().clamp(min=1)
            p_E, z2 = (probs_TE * valid_T[:, None]).sum(0) / mine, (z2_T * valid_T).sum() / mine
            share = mine / max(tokens, 1)
        aux = n_exp * (f_E * p_E).sum() * share
        z = z2 * share
        kept_E = _count(expert_TK[keep_TK], n_exp)
        routed_E = routed_group_E if mine_T is None else _count(expert_TK, n_exp)
        return Routing(expert_TK, gate_TK, keep_TK, aux, z, kept_E, routed_E, capacity, tokens, valid_T)

    def group_choices(self, expert_TK: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the routing group's choices [G, K] in token order, the rows of this device's T tokens in it).

        One device holds the whole group: (``expert_TK``, None). Context parallelism overrides this."""
        return expert_TK, None


def _real_count(real_G: torch.Tensor, counted_T: torch.Tensor, batch: int, whole_group: bool) -> int:
    """Real tokens in the routing group (an int: it sets the capacity); from the host's mask ``counted_T``
    [T] when this device holds the whole group (the same count as ``real_G`` [G]: no wait for the device)."""
    if whole_group and counted_T.device.type == "cpu":
        return int(real_tokens(counted_T.reshape(batch, -1)).sum())
    return int(real_G.sum())


def _uniform(key: TokenKey | None, batch: int, shape: torch.Size, device) -> torch.Tensor:
    """[T, W] float32 uniform in (0, 1): a function of each token when keyed, else from torch's state."""
    if key is None:
        return torch.rand(shape, device=device).clamp_(min=2**-24)  # clamp: log(0) would be -inf
    return token_uniform(key, batch, shape[0], shape[1], device)


def _count(expert: torch.Tensor, n_exp: int) -> torch.Tensor:
    """Assignments per expert [E] (long) among the expert indices ``expert`` (any shape; padding's n_exp
    is not counted)."""
    flat = expert.reshape(-1)
    counts = torch.zeros(n_exp + 1, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[:n_exp]


def _fill_slots(expert_TK: torch.Tensor, n_exp: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep_TK, routed_E): choice-major, token-order slot filling; routed_E counts before dropping.
    Padding's choice n_exp (no expert) is never kept nor counted."""
    keep = torch.empty_like(expert_TK, dtype=torch.bool)
    filled_E = torch.zeros(n_exp, dtype=torch.long, device=expert_TK.device)
    for j in range(expert_TK.shape[1]):
        onehot_TE = F.one_hot(expert_TK[:, j], n_exp + 1)[:, :n_exp]
        slot_T = ((onehot_TE.cumsum(0) - 1 + filled_E) * onehot_TE).sum(1)  # 0-based slot in its expert
        keep[:, j] = (slot_T < capacity) & expert_TK[:, j].lt(n_exp)
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
    ``token_key``: the current micro-batch's :class:`TokenKey` (:func:`key_tokens`), for the router's noise;
    ``counted_BS``: which of its targets count (:func:`mark_padding`); padding is routed nowhere.
    """

    # class defaults: expert-parallel copies built without __init__ have them too
    token_key: TokenKey | None = None
    counted_BS: torch.Tensor | None = None

    def __init__(self, dim: int, hidden: int, num_experts: int, cfg: MoEConfig, expert=None):
        """``expert``: None (SwiGLU experts of ``hidden`` units), or a user's expert (:func:`expert_copies`)."""
        super().__init__()
        self.cfg = cfg.validate()
        self.num_experts = num_experts
        self.router = Router(dim, num_experts, cfg)
        self.experts = (nn.ModuleList(FeedForward(dim, hidden) for _ in range(num_experts)) if expert is None
                        else expert_copies(expert, num_experts))
        if cfg.use_residual:  # DeepSpeed residual MoE: out = c0·moe(x) + c1·mlp(x), c = softmax(Wx)
            self.residual_mlp = FeedForward(dim, hidden)
            self.residual_coef = nn.Linear(dim, 2, bias=False)
        if cfg.num_shared_experts:  # n shared experts fused into one MLP of n·F hidden units
            self.shared_experts = FeedForward(dim, hidden * cfg.num_shared_experts)
        self.pending_loss: torch.Tensor | None = None  # weighted aux + z of the last training forward
        self.stats = MoEStats.zeros(num_experts)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        counted_T = None if self.counted_BS is None else self.counted_BS.reshape(-1)  # the router moves it
        routing = self.router(x_TD, batch=x_BSD.shape[0] if x_BSD.dim() == 3 else 1, key=self.token_key,
                              counted_T=counted_T)
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


def expert_copies(expert, num_experts: int) -> nn.ModuleList:
    """``num_experts`` experts from a user's expert, any module mapping [T, D] to [T, D] (as DeepSpeed's
    ``MoE(hidden_size, expert=...)``): an ``nn.Module`` is deep-copied, so every expert starts from its
    values (DeepSpeed's rule); a factory (a callable that is not a module) is called once per expert, in
    expert order, so each draws its own initial values from torch's random state (seed it first)."""
    if isinstance(expert, nn.Module):
        return nn.ModuleList(copy.deepcopy(expert) for _ in range(num_experts))
    if not callable(expert):
        raise ConfigError(f"an expert must be an nn.Module or a callable returning one, got {type(expert).__name__}")
    made = [expert() for _ in range(num_experts)]
    if not all(isinstance(m, nn.Module) for m in made):
        raise ConfigError("the expert factory must return an nn.Module each time it is called")
    return nn.ModuleList(made)


def use_experts(model: nn.Module, expert) -> nn.Module:
    """Give every MoE layer of ``model`` (e.g. a built ``Transformer``) the user's experts, in layer order
    (:func:`expert_copies`); in place, before any strategy (expert parallelism then shards them as it
    shards the SwiGLU ones: each ep rank keeps its E/ep). Returns ``model``."""
    for layer in moe_layers(model):
        layer.experts = expert_copies(expert, layer.num_experts)
    return model


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """Every MoE feed-forward in ``model`` (any wrapper around it is fine), in module order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


class MoELayers(list):
    """A model's MoE feed-forwards found once, in module order, with their block indices (``indices``: they
    name the tokens' noise). The helpers below take one in place of the model, so a caller that marks every
    micro-batch does not walk the modules each time; find it after expert parallelism replaced the layers."""

    def __init__(self, model: nn.Module):
        named = [(n, m) for n, m in model.named_modules() if isinstance(m, MoEFeedForward)]
        super().__init__(m for _, m in named)
        self.indices = [layer_index(n, i) for i, (n, _) in enumerate(named)]


def _found(model: nn.Module | MoELayers) -> MoELayers:
    """``model``'s MoE layers: as given when already found, else found now."""
    return model if isinstance(model, MoELayers) else MoELayers(model)


def key_tokens(model: nn.Module | MoELayers, seed: int | None, first_row: int = 0) -> None:
    """Name the next micro-batch's tokens for every MoE layer's training noise: its rows are the run's
    samples ``first_row``, ``first_row + 1``, … (``seed`` None: forget the key, use torch's random state).
    ``Transformer.forward`` adds the positions (:func:`key_positions`)."""
    found = _found(model)
    for index, layer in zip(found.indices, found):
        layer.token_key = None if seed is None else TokenKey(seed, index, first_row)


def mark_padding(model: nn.Module | MoELayers, counted_BS: torch.Tensor | None) -> None:
    """Tell every MoE layer which targets [B, S] of the next micro-batches count (None: all do), so its
    router leaves the padding (``moe_tokens.real_tokens``) out."""
    for layer in _found(model):
        layer.counted_BS = counted_BS


def key_positions(model: nn.Module, positions_L: torch.Tensor | None) -> None:
    """The absolute positions [L] of the tokens of every row (None: 0..L-1) for keyed MoE layers."""
    for layer in moe_layers(model):
        if layer.token_key is not None:
            layer.token_key.positions_L = positions_L


def moe_loss_sum(model: nn.Module | MoELayers) -> torch.Tensor | float:
    """The routing loss of the last training forward, as a SUM to add to the summed token loss.

    Call once per micro-batch, right after ``model(x)``: ``(ce_sum + moe_loss_sum(model)) / global_tokens``
    (a second forward before the call replaces the first one's term). Returns 0.0 for a dense model, in
    eval mode, or when already collected.
    """
    total: torch.Tensor | float = 0.0
    for layer in _found(model):
        if layer.pending_loss is not None:
            total = total + layer.pending_loss
            layer.pending_loss = None
    return total


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
