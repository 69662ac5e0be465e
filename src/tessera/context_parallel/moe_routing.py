"""Mixture-of-experts routing under context parallelism: one routing group, decided as one process would.

The routing group of an MoE layer is one micro-batch on one data-parallel rank: T = B·S tokens, taken in
token order b·S + s. Under cp each rank holds only its zig-zag chunks (L = S/cp positions of every
sequence), so routing each rank's tokens alone would change the capacity (from B·L tokens, not B·S) and
the slot order (which tokens are dropped). Instead:

  1. each rank chooses the top-k experts of its own tokens (per token: nothing to share);
  2. all-gather the choices over cp: [cp·B·L, K] int64, K·8 bytes a token;
  3. scatter them to their global token index b·S + position (the layout of ``layout.py``), fill the
     slots of the whole group with the one-device rule, and keep this rank's rows.

The load-balancing and z losses need f_e (from the gathered choices: the same on every cp rank, no
gradient) and the means of p_e and z over the group's T tokens: each rank adds its tokens' share
(``Router.forward``), so no collective sits in autograd and the router's gradient is summed with every
other gradient over dp × cp. The experts then compute per token, on this rank's rows only.

Forward communication: one all-gather of the choices per MoE layer per forward, on the ``cp`` group.
Backward communication: none.

Legend: B sequences, L local tokens per sequence, S = cp·L, T = B·L local tokens, G = cp·T, K top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.context_parallel.layout import unshard_order
from tessera.models.moe import MoEFeedForward, Router


class ContextParallelRouter(Router):
    """A :class:`Router` whose routing group is the micro-batch spread over the ``cp`` ranks.

    Built from the single-device router (the ``gate`` by reference, so parameter names stay). ``cp`` is
    the context-parallel group; ``tessera.moe.moe_metrics`` sums the routing counters (per-rank shares)
    over dp × cp.
    """

    def __init__(self, router: Router, cp: CommGroup):
        nn.Module.__init__(self)
        self.cfg, self.num_experts, self.cp = router.cfg, router.num_experts, cp
        self.gate = router.gate

    def group_choices(self, expert_TK: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, (tokens, k) = self.cp.size, expert_TK.shape
        gathered_GK = expert_TK.new_empty(n * tokens, k)  # rank j's T rows at j·T …
        comm.all_gather(gathered_GK, expert_TK.contiguous(), self.cp)
        rows_RT = group_rows(batch, tokens // max(batch, 1), n, expert_TK.device)
        group_GK = torch.empty_like(gathered_GK)
        group_GK[rows_RT.reshape(-1)] = gathered_GK
        return group_GK, rows_RT[self.cp.rank]


def group_rows(batch: int, local_len: int, cp: int, device=None) -> torch.Tensor:
    """[cp, B·L]: the token index b·S + s in the whole group of each token rank j holds (in its order)."""
    seq = local_len * cp
    pos_RL = unshard_order(seq, cp, device).view(cp, local_len)  # rank j's positions
    start_B = torch.arange(batch, device=device) * seq
    return (start_B[None, :, None] + pos_RL[:, None, :]).reshape(cp, batch * local_len)


def route_over_context(model: nn.Module, cp: CommGroup) -> int:
    """In place: every MoE layer of ``model`` routes its micro-batch as one group over ``cp``.
    Returns how many routers were replaced."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    for layer in layers:
        if not isinstance(layer.router, ContextParallelRouter):
            layer.router = ContextParallelRouter(layer.router, cp)
    return len(layers)
