"""Row-wise optimizers a server applies to the rows a push touched (untouched rows and their state stay put).

Each formula is the one torch uses, so a synchronous parameter server equals single-process torch
training: SGD and Adagrad as ``torch.optim.SGD`` / ``torch.optim.Adagrad`` (a zero gradient row is a
no-op for both); Adam on a sparse table as ``torch.optim.SparseAdam`` (lazy: only touched rows' moments
move; the bias correction uses the table's update count) and on a dense tensor as ``torch.optim.Adam``.
"""

from __future__ import annotations

import math

import torch


class RowOptimizer:
    """State for one table ``[R, C]``; ``apply(rows, grad_rows)`` updates ``table[rows]`` in place."""

    def __init__(self, name: str, table: torch.Tensor, lr: float, dense: bool,
                 betas=(0.9, 0.999), eps: float | None = None):
        self.name, self.table, self.lr, self.dense = name, table, lr, dense
        self.beta1, self.beta2 = betas
        self.eps = eps if eps is not None else (1e-10 if name == "adagrad" else 1e-8)
        self.step = 0  # updates applied to this table (Adam's bias correction)
        self.state = {}
        if name == "adagrad":
            self.state["sum"] = torch.zeros_like(table)
        elif name == "adam":
            self.state["m"] = torch.zeros_like(table)
            self.state["v"] = torch.zeros_like(table)

    def apply(self, rows_U: torch.Tensor, grad_UC: torch.Tensor) -> None:
        """``rows_U`` unique row indices of this table, ``grad_UC`` their (already summed) gradients."""
        self.step += 1
        p_UC = self.table[rows_U]
        if self.name == "sgd":
            p_UC -= self.lr * grad_UC
        elif self.name == "adagrad":
            s_UC = self.state["sum"][rows_U] + grad_UC * grad_UC
            self.state["sum"][rows_U] = s_UC
            p_UC -= self.lr * grad_UC / (s_UC.sqrt() + self.eps)
        else:
            p_UC = self._adam(rows_U, grad_UC, p_UC)
        self.table[rows_U] = p_UC

    def _adam(self, rows_U, grad_UC, p_UC):
        m_UC = self.state["m"][rows_U].lerp(grad_UC, 1 - self.beta1)
        v_UC = self.state["v"][rows_U] * self.beta2 + (1 - self.beta2) * grad_UC * grad_UC
        self.state["m"][rows_U], self.state["v"][rows_U] = m_UC, v_UC
        bc1, bc2 = 1 - self.beta1 ** self.step, 1 - self.beta2 ** self.step
        if self.dense:  # torch.optim.Adam
            return p_UC - (self.lr / bc1) * m_UC / (v_UC.sqrt() / math.sqrt(bc2) + self.eps)
        return p_UC - (self.lr * math.sqrt(bc2) / bc1) * m_UC / (v_UC.sqrt() + self.eps)  # SparseAdam

    def state_dict(self) -> dict:
        return {"step": self.step, **{k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        for k in self.state:
            self.state[k].copy_(sd[k])
