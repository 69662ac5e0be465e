"""Expert parallelism: the E experts of an MoE layer sharded over the ``ep`` ranks, E/ep on each.

Rank r of the ep group holds experts ``r·E/ep … (r+1)·E/ep − 1``; the router, residual MLP and shared
experts stay replicated. Each rank routes ITS OWN tokens (so capacity and dropping are decided per
rank, exactly as one process routing that rank's micro-batch would; under context parallelism the
router decides the micro-batch its cp ranks share as one group, see
``tessera.context_parallel.moe_routing``, and this rank dispatches its own tokens' kept rows), then:

Forward communication (per MoE layer, on the ``ep`` group):
  1. all-to-all of the per-expert row counts ([ep, E/ep] int64), so every rank knows its receive splits;
  2. dispatch: all-to-all (uneven splits) of the kept token rows [N, D] to the ranks owning their expert;
  3. combine: the inverse all-to-all of the expert outputs back to the rows' home ranks.
Backward communication: the inverse of 3 and of 2 (two all-to-alls of gradients, same sizes); none for
the counts. No capacity padding is sent: a rank sends exactly the rows it keeps, so the dispatch
moves rows·D·bytes·(share of rows owned by other ranks) per direction.

LoRA: an expert's adapters (``tessera.lora``, on its w1 / w2 / w3) are submodules of its linear layers,
so they move with the expert and are expert parameters like its weights; the router takes none.

Gradients of expert weights are complete for the ep group's tokens after backward; reducing them over
the expert-data-parallel ranks (``edp``) and the dense ones over ``dp`` is
:class:`tessera.moe.ExpertDataParallel`'s job.

Legend: T local tokens, D model dim, N dispatched rows, M received rows, R ep ranks, X local experts.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.comm.group import CommGroup
from tessera.models.moe import MoEFeedForward, Routing, combine, dispatch_plan, run_local_experts
from tessera.moe.all_to_all import all_to_all, exchange_counts


class ExpertParallelMoE(MoEFeedForward):
    """An :class:`MoEFeedForward` whose ``experts`` holds only this ep rank's E/ep experts.

    Built from a full single-device layer (same router, residual and shared modules, by reference);
    ``expert_offset`` is the global index of ``experts[0]``.
    """

    def __init__(self, dense: MoEFeedForward, ep: CommGroup):
        nn.Module.__init__(self)
        if dense.num_experts % ep.size:
            raise ValueError(f"{dense.num_experts} experts cannot be split evenly over ep={ep.size} ranks")
        self.cfg, self.num_experts, self.ep = dense.cfg, dense.num_experts, ep
        self.local_experts = dense.num_experts // ep.size
        self.expert_offset = ep.rank * self.local_experts
        for name, child in dense.named_children():
            if name != "experts":
                setattr(self, name, child)
        self.experts = nn.ModuleList(dense.experts[self.expert_offset : self.expert_offset + self.local_experts])
        self.pending_loss, self.stats = None, dense.stats

    def run_experts(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        token_N, slot_N, count_E = dispatch_plan(routing, self.num_experts)
        send_RX = count_E.view(self.ep.size, self.local_experts)
        recv_RX = exchange_counts(send_RX, self.ep)  # row s: rows rank s sends to each local expert
        in_splits, out_splits = send_RX.sum(1).tolist(), recv_RX.sum(1).tolist()
        x_MD = all_to_all(x_TD[token_N], out_splits, in_splits, self.ep)  # grouped (source, expert)
        by_expert_M, counts = _group_by_expert(recv_RX)
        y_MD = run_local_experts(self.experts, x_MD[by_expert_M], counts)
        y_MD = y_MD[torch.argsort(by_expert_M)]  # back to (source, expert) order
        y_ND = all_to_all(y_MD, in_splits, out_splits, self.ep)
        return combine(y_ND, slot_N, routing.gate_TK)


def _group_by_expert(recv_RX: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Permutation taking received rows from (source rank, expert) order to (expert, source) order,
    and the row count of each local expert."""
    n_src, n_loc = recv_RX.shape
    start_RX = (recv_RX.reshape(-1).cumsum(0) - recv_RX.reshape(-1)).view(n_src, n_loc)
    pieces = [torch.arange(int(start_RX[s, e]), int(start_RX[s, e] + recv_RX[s, e]))
              for e in range(n_loc) for s in range(n_src)]
    perm = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return perm.to(recv_RX.device), recv_RX.sum(0).tolist()


def apply_expert_parallel(model: nn.Module, ep: CommGroup) -> nn.Module:
    """Replace every MoE feed-forward of ``model`` by its expert-parallel shard (in place); returns it.

    Every rank must start from the same full model (same seed) or the replicated parts must be
    broadcast afterwards (ExpertDataParallel does both: dense over dp, experts over edp).
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, MoEFeedForward) and not isinstance(child, ExpertParallelMoE):
                setattr(module, name, ExpertParallelMoE(child, ep))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of the experts sharded over ep (reduced over edp); everything else is dense."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()]


def global_expert_state(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Local parameter name → (global expert index, name inside the expert), for checkpoints and tests."""
    out = {}
    for mod_name, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            for i, expert in enumerate(m.experts):
                for p_name, _ in expert.named_parameters():
                    out[f"{mod_name}.experts.{i}.{p_name}"] = (m.expert_offset + i, p_name)
    return out
