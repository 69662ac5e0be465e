"""Per-layer routing counters of the MoE feed-forward (``models/moe.py``) and the metrics made from them.

Legend: E experts, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch


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

    def add(self, routing) -> None:
        """Count one forward's ``routing`` (a ``models.moe.Routing``; not imported: moe imports this)."""
        values, n_exp = self.on(routing.kept_E.device), routing.kept_E.numel()
        values[:n_exp].add_(routing.kept_E)
        values[n_exp : 2 * n_exp].add_(routing.routed_E)
        tokens, k = routing.expert_TK.shape  # Python ints: kernel arguments, no copy
        if routing.valid_T is not None:  # real tokens only (a device tensor: still no copy)
            tokens = routing.valid_T.sum()
        values[2 * n_exp].add_(routing.dropped_TK.sum())
        values[2 * n_exp + 1].add_(tokens * k)
        values[2 * n_exp + 2].add_(tokens)
        values[2 * n_exp + 3].add_(routing.aux_loss.detach().double() * routing.tokens)
        values[2 * n_exp + 4].add_(routing.z_loss.detach().double() * routing.tokens)

    def reset(self) -> None:
        self.values.zero_()


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
