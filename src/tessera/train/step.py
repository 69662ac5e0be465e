"""One optimizer step's forward/backward over micro-batches, and the validation loss.

Token weighting: every micro-batch's summed token loss is divided by the number of tokens in the whole
global batch (all data-parallel ranks, all micro-batches), and data-parallel gradients are summed. The
gradient is then exactly that of the mean loss over the global batch, as on one process, whether or not
ranks and micro-batches hold equal numbers of tokens.

Shapes: x_BS, y_BS token ids (B micro-batch, S sequence); logits_BSV.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import CommGroup
from tessera.models import cross_entropy_sum, moe_loss_sum
from tessera.models.moe import MoELayers, key_tokens, mark_padding

IGNORE_INDEX = -100


@dataclass
class StepResult:
    loss: float  # mean token loss over the global batch
    tokens: int  # tokens in the global batch


def global_token_count(batches: list[tuple[torch.Tensor, torch.Tensor]], dp: CommGroup,
                       device: torch.device) -> torch.Tensor:
    """Targets that count (not IGNORE_INDEX) over every micro-batch and data-parallel rank: a 0-d tensor."""
    local = sum(int(y.ne(IGNORE_INDEX).sum()) for _, y in batches)
    count = torch.tensor(float(local), dtype=torch.float64, device=device)
    comm.all_reduce(count, dp)
    return count


def counted_targets(y_BS: torch.Tensor) -> torch.Tensor | None:
    """bool [B, S]: the targets that count, for the MoE routers to leave padding out (None: all count)."""
    counted_BS = y_BS.ne(IGNORE_INDEX)
    return None if bool(counted_BS.all()) else counted_BS


def forward_backward(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], dp: CommGroup,
                     device: torch.device, activation_tracker=None, loss_scale: float = 1.0,
                     loss_fn=cross_entropy_sum, timer=None, rows: tuple[int, int] | None = None) -> StepResult:
    """Accumulate gradients of the global-mean loss over ``batches``; reduce them on the last one only.

    ``dp`` is every group of ranks that see different tokens of the step (dp × cp). ``loss_scale``
    multiplies the loss before backward (loss scaling); the reported loss is unscaled, and the caller
    divides the scale out of the gradients before reading them (``tessera.precision.unscale_``, or a
    sharded engine's ``clip_grad_norm(max_norm, inv_scale)``).
    ``loss_fn(logits, targets, ignore_index) -> (sum, count)``, e.g. the vocabulary-parallel loss under tp.
    A mixture-of-experts model's routing losses are added as sums (see ``models/moe.py``) but not reported;
    its routers leave padding out (``models.moe_tokens.real_tokens``), so padded rows train as they would unpadded.
    ``timer`` (a ``tessera.observe.step_time.StepTimer``) times the forward and backward parts when given.
    ``rows``: (run seed, the run's sample index of this rank's first row): names each micro-batch's tokens
    for the MoE routers' noise (``models.moe.key_tokens``), so it is the same on any layout.
    """
    phase = timer.phase if timer is not None else (lambda name: contextlib.nullcontext())
    total_tokens = global_token_count(batches, dp, device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    moe = MoELayers(model)  # found once: every micro-batch marks them and collects their losses
    last = len(batches) - 1
    for i, (x, y) in enumerate(batches):
        if moe:  # from the host's targets: on an accelerator its all() would wait for the copy below
            mark_padding(moe, counted_targets(y))
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if rows is not None:  # this micro-batch's rows follow the previous ones' in the run's order
            key_tokens(moe, rows[0], rows[1] + sum(b[0].shape[0] for b in batches[:i]))
        sync = i == last or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            tracking = activation_tracker() if (activation_tracker and i == 0) else contextlib.nullcontext()
            with phase("forward"):
                with tracking:  # the loss's saved logits count as activations too
                    s, _ = loss_fn(model(x), y, ignore_index=IGNORE_INDEX)
                scaled = (s + moe_loss_sum(moe)) / total_tokens.to(s.dtype)
            with phase("backward"):
                (scaled * loss_scale if loss_scale != 1.0 else scaled).backward()
        loss_sum += s.detach().double()
    if rows is not None:
        key_tokens(moe, None)  # later forwards (outside a step) are not these rows
    if moe:
        mark_padding(moe, None)
    comm.all_reduce(loss_sum, dp)
    return StepResult(loss=float(loss_sum / total_tokens), tokens=int(total_tokens))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[list[tuple[torch.Tensor, torch.Tensor]]], dp: CommGroup,
             device: torch.device, loss_fn=cross_entropy_sum) -> float:
    """Mean token loss over this rank's share of the fixed validation batches, averaged over ranks."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, token count]
    moe = MoELayers(model)
    for micro_batches in batches:
        for x, y in micro_batches:
            if moe:  # padding takes no expert capacity in evaluation either (from the host's targets)
                mark_padding(moe, counted_targets(y))
            y = y.to(device)
            s, n = loss_fn(model(x.to(device)), y, ignore_index=IGNORE_INDEX)
            totals[0] += s.double()
            totals[1] += n
    if moe:
        mark_padding(moe, None)
    comm.all_reduce(totals, dp)
    model.train(was_training)
    return float(totals[0] / totals[1])
