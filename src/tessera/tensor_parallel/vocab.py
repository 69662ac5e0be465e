"""The vocabulary split over tp: embedding, output head and a cross-entropy that never sees full logits.

Legend: B batch, S sequence, D model dim, V vocabulary, Vp = V rounded up to a multiple of N (tp size),
v = Vp / N the rows a rank holds. Rank r owns token ids [r·v, (r+1)·v); ids ≥ V are padding, never looked
up, and their logits are −inf, so padding changes neither the loss nor any gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm import collectives as C
from tessera.comm.group import CommGroup
from tessera.tensor_parallel.linear import ColumnParallelLinear, _assign_rows, mark_sharded
from tessera.tensor_parallel.regions import reduce_scatter_seq


def padded_vocab(vocab_size: int, tp: int) -> int:
    """V rounded up to a multiple of tp."""
    return -(-vocab_size // tp) * tp


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r·v, (r+1)·v) of the table; other ids read zeros, and the ranks' outputs sum.

    Forward: the partial [B, S, D] rows are all-reduced ("reduce"), or reduce-scattered along the sequence
    under SP ("reduce_scatter", giving [B, S/N, D]). Backward: identity, or an all-gather of the gradient
    along the sequence; each rank's table gets gradient only for the ids it owns.
    """

    def __init__(self, num_embeddings: int, dim: int, group: CommGroup, output_mode: str = "reduce",
                 device: torch.device | None = None):
        super().__init__()
        self.group, self.output_mode = group, output_mode
        self.num_embeddings, self.dim = num_embeddings, dim
        self.padded = padded_vocab(num_embeddings, group.size)
        self.per_rank = self.padded // group.size
        self.vocab_start = group.rank * self.per_rank
        self.weight = mark_sharded(nn.Parameter(torch.zeros(self.per_rank, dim, device=device)))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: CommGroup, **kw) -> VocabParallelEmbedding:
        """This rank's rows of ``emb`` (on its device; on the meta device only their origin)."""
        layer = cls(emb.num_embeddings, emb.embedding_dim, group, device=emb.weight.device, **kw)
        with torch.no_grad():
            _assign_rows(layer.weight, emb.weight, group, layer.padded)
        return layer

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        local_BS = tokens_BS - self.vocab_start
        outside_BS = (local_BS < 0) | (local_BS >= self.per_rank)
        h_BSD = F.embedding(local_BS.masked_fill(outside_BS, 0), self.weight)
        h_BSD = h_BSD.masked_fill(outside_BS.unsqueeze(-1), 0.0)  # ids another rank owns read zeros
        if self.output_mode == "reduce_scatter":
            return reduce_scatter_seq(h_BSD, self.group, dim=1)
        return comm.reduce_from(h_BSD, self.group)


class VocabParallelHead(ColumnParallelLinear):
    """The output projection split by vocabulary rows: [B, S, D] → local logits [B, S, v].

    Communication is the ColumnParallelLinear's (input f or SP all-gather; output stays split). Columns of
    padding ids are −inf. Feed the result to :func:`vocab_parallel_cross_entropy_sum`, or
    :func:`gather_logits` when full logits are really wanted (generation).
    """

    def __init__(self, *args, vocab_size: int, **kw):
        super().__init__(*args, **kw)
        self.vocab_size = vocab_size
        self.init_buffers(self.weight.device)

    def init_buffers(self, device: torch.device) -> None:
        """``padding_v`` [v] (bool): which of this rank's columns are padding ids (also called by
        ``tessera.models.init.materialize`` for a head built on the meta device)."""
        v = self.weight.shape[0]
        ids_v = torch.arange(self.group.rank * v, (self.group.rank + 1) * v, device=device)
        self.register_buffer("padding_v", ids_v >= self.vocab_size, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: CommGroup, **kw):
        """This rank's vocabulary rows of ``linear`` (on its device; on the meta device only their origin)."""
        padded = padded_vocab(linear.out_features, group.size)
        head = cls(linear.in_features, linear.out_features, group, bias=False, padded_out=padded,
                   vocab_size=linear.out_features, device=linear.weight.device, **kw)
        with torch.no_grad():
            _assign_rows(head.weight, linear.weight, group, padded)
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return logits.masked_fill(self.padding_v, float("-inf")) if bool(self.padding_v.any()) else logits


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss from vocab-split logits [T, v]: 3 all-reduces of T floats (max, target logit, Σexp).

    Backward needs no communication: dlogits_r = softmax_r − onehot_r, scaled by the incoming gradient.
    """

    @staticmethod
    def forward(ctx, logits_Tv, targets_T, group, ignore_index):
        logits_Tv = logits_Tv.float()
        v = logits_Tv.shape[-1]
        max_T = logits_Tv.detach().max(dim=-1).values
        C.all_reduce(max_T, group, op="max")  # for stability only: the loss does not depend on it
        shifted_Tv = logits_Tv - max_T.unsqueeze(-1)
        local_T = targets_T - group.rank * v
        mine_T = (local_T >= 0) & (local_T < v)
        idx_T = local_T.clamp(0, v - 1)
        target_logit_T = torch.where(mine_T, shifted_Tv.gather(-1, idx_T.unsqueeze(-1)).squeeze(-1), 0.0)
        C.all_reduce(target_logit_T, group)
        exp_Tv = shifted_Tv.exp()  # padding columns are −inf → 0
        sum_exp_T = exp_Tv.sum(dim=-1)
        C.all_reduce(sum_exp_T, group)
        valid_T = targets_T != ignore_index
        loss_T = torch.where(valid_T, sum_exp_T.log() - target_logit_T, 0.0)
        exp_Tv.div_(sum_exp_T.unsqueeze(-1))  # now the local slice of the softmax
        ctx.save_for_backward(exp_Tv, idx_T, mine_T & valid_T, valid_T)
        return loss_T

    @staticmethod
    def backward(ctx, grad_T):
        softmax_Tv, idx_T, hit_T, valid_T = ctx.saved_tensors
        grad_Tv = softmax_Tv.clone()
        grad_Tv.scatter_add_(-1, idx_T.unsqueeze(-1), -hit_T.to(grad_Tv.dtype).unsqueeze(-1))
        grad_Tv.mul_((grad_T * valid_T).unsqueeze(-1))
        return grad_Tv, None, None, None


def vocab_parallel_cross_entropy_sum(logits_BSv: torch.Tensor, targets_BS: torch.Tensor, group: CommGroup,
                                     ignore_index: int = -100) -> tuple[torch.Tensor, int]:
    """(sum of per-token losses, non-ignored token count) from vocab-split logits, like ``cross_entropy_sum``.

    Every tp rank returns the same sum; backward gives each rank the gradient of its own logit slice.
    """
    v = logits_BSv.shape[-1]
    loss_T = _VocabParallelCE.apply(logits_BSv.reshape(-1, v), targets_BS.reshape(-1), group, ignore_index)
    return loss_T.sum(), int((targets_BS != ignore_index).sum().item())


class TensorParallelLoss:
    """``loss_fn(logits, targets, ignore_index) -> (sum, count)``: a drop-in for ``cross_entropy_sum``."""

    def __init__(self, group: CommGroup):
        self.group = group

    def __call__(self, logits_BSv, targets_BS, ignore_index: int = -100):
        return vocab_parallel_cross_entropy_sum(logits_BSv, targets_BS, self.group, ignore_index)


def gather_logits(logits_BSv: torch.Tensor, group: CommGroup, vocab_size: int) -> torch.Tensor:
    """Full logits [B, S, V] from the split ones (all-gather; padding columns dropped). For eval only."""
    return comm.gather_from(logits_BSv, group, dim=-1)[..., :vocab_size]
