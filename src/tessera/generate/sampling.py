"""Choosing the next token from the logits of the last position: greedy, or top-p (nucleus) sampling.

Top-p (Holtzman et al. 2019): p = softmax(logits / temperature); keep the smallest set of most likely
tokens whose probabilities sum to at least ``top_p`` (the most likely token always), renormalise, draw.
Draws come from a CPU generator seeded once per generation, so a seed gives the same tokens on any
device. Ties go to the lower token id, in greedy choice and in the nucleus order alike, so top_p → 0
is greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.errors import UserError


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy decoding (``top_p`` and ``seed`` unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> Sampling:
        if not self.temperature >= 0.0:
            raise UserError(f"--temperature must be 0 (greedy) or positive, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def nucleus_probs(logits_V: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The renormalised top-p distribution [V] (float32, CPU): zero outside the nucleus."""
    probs_V = torch.softmax(logits_V.detach().float().cpu() / temperature, dim=-1)
    sorted_V, order_V = torch.sort(probs_V, descending=True, stable=True)
    before_V = torch.cumsum(sorted_V, dim=-1) - sorted_V  # mass of the more likely tokens
    keep_V = before_V < top_p
    keep_V[0] = True
    kept_V = torch.zeros_like(probs_V).scatter_(0, order_V[keep_V], sorted_V[keep_V])
    return kept_V / kept_V.sum()


def next_token(logits_V: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token id from the last position's logits [V]."""
    if sampling.greedy:
        return int(torch.argmax(logits_V))
    probs_V = nucleus_probs(logits_V, sampling.temperature, sampling.top_p)
    return int(torch.multinomial(probs_V, 1, generator=generator))
