"""A synthetic click log with a planted ground-truth model, and the AUC metric.

Each field f draws a raw categorical value v from a Zipf-like law over ``raw_vocab`` values (popular
values recur, the tail is long, as in real CTR logs). The planted model gives every (f, v) a weight
w[f, v] and low-rank vectors u[f, v]; the true click probability is

    p = sigmoid(bias + Σ_f w[f, v_f] + Σ_{pairs (a, b)} <u[a, v_a], u[b, v_b]>)

and the label is a Bernoulli(p) draw. The model only sees v hashed into ``buckets`` per field (so it
suffers collisions), and no model can beat ``ceiling_auc``: the AUC of the true p on the same labels.
Batches are a pure function of (seed, step, worker), so runs are reproducible in any process layout.
"""

from __future__ import annotations

import torch

_MIX = 2654435761  # Knuth's multiplicative hash constant


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied scores given their average rank)."""
    scores, labels = scores.detach().double().flatten(), labels.detach().flatten() > 0.5
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs at least one positive and one negative label")
    uniq, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # 0-based rank of each distinct score's first occurrence
    avg_rank = first.double() + (counts.double() + 1) / 2  # 1-based average rank of a tie group
    rank_sum = avg_rank[inverse][labels].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


class ClickLog:
    """Deterministic synthetic CTR data: ``batch(step, worker, size)`` → (fields [B, F] in [0, K), labels [B])."""

    def __init__(self, n_fields: int, buckets: int, raw_vocab: int = 0, seed: int = 0,
                 rank: int = 4, bias: float = -1.0):
        self.n_fields, self.buckets, self.seed = n_fields, buckets, seed
        self.raw_vocab = raw_vocab or 4 * buckets
        g = torch.Generator().manual_seed(10_007 + seed)
        self.w_FV = torch.randn(n_fields, self.raw_vocab, generator=g) * 0.8
        self.u_FVR = torch.randn(n_fields, self.raw_vocab, rank, generator=g) * 0.5
        self.bias = bias
        ranks = torch.arange(1, self.raw_vocab + 1, dtype=torch.float64)
        self.popularity_V = (ranks ** -1.1) / (ranks ** -1.1).sum()

    def _generator(self, step: int, worker: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step * 10_007 + worker * 101 + 7) % 2**62)

    def raw(self, n: int, g: torch.Generator) -> torch.Tensor:
        """Raw categorical values [n, F] in [0, raw_vocab)."""
        return torch.multinomial(self.popularity_V, n * self.n_fields, replacement=True, generator=g).view(
            n, self.n_fields)

    def true_logit(self, raw_BF: torch.Tensor) -> torch.Tensor:
        f_F = torch.arange(self.n_fields)
        logit_B = self.bias + self.w_FV[f_F, raw_BF].sum(1)
        u_BFR = self.u_FVR[f_F, raw_BF]
        for a in range(0, self.n_fields - 1, 2):  # interactions between neighbouring field pairs
            logit_B = logit_B + (u_BFR[:, a] * u_BFR[:, a + 1]).sum(-1)
        return logit_B

    def hashed(self, raw_BF: torch.Tensor) -> torch.Tensor:
        """Raw values → bucket ids [B, F] in [0, K); different fields hash differently."""
        f_F = torch.arange(self.n_fields)
        return ((raw_BF * _MIX + f_F * 40_503 + 12_345) % (2**32)) % self.buckets

    def sample(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raw_BF = self.raw(n, g)
        p_B = torch.sigmoid(self.true_logit(raw_BF))
        labels_B = torch.bernoulli(p_B, generator=g)
        return self.hashed(raw_BF), labels_B, p_B

    def batch(self, step: int, worker: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        fields, labels, _ = self.sample(size, self._generator(step, worker))
        return fields, labels

    def eval_set(self, size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Held-out (fields, labels) and the ceiling AUC of the planted model on them."""
        fields, labels, p = self.sample(size, self._generator(-1, -1))
        return fields, labels, auc(p, labels)
