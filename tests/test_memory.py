"""MemoryLedger: bytes counted from live tensors, deduplicated by storage (pure tier)."""

import torch
from torch import nn

from tessera.models import Transformer, model_config
from tessera.train.memory import MemoryLedger, storage_bytes


def test_storage_is_counted_once():
    base = torch.zeros(100)
    assert storage_bytes([base, base[:10], base.view(10, 10)]) == 400
    assert storage_bytes([torch.zeros(3), torch.zeros(5, dtype=torch.float64), None]) == 12 + 40


def test_model_state_and_tied_weights():
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", tie_embeddings=True))
    n = sum(p.numel() for p in model.parameters())  # the tied weight appears once
    opt = torch.optim.AdamW(model.parameters())
    ledger = MemoryLedger(model, opt)
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    snap = ledger.snapshot()
    assert snap.params == snap.grads == 4 * n
    n_tensors = len(list(model.parameters()))
    assert snap.optimizer == 2 * 4 * n + 4 * n_tensors  # exp_avg, exp_avg_sq, one fp32 step each


def test_gradient_buffers_count_once_with_their_views():
    model = nn.Linear(10, 10)
    flat = torch.zeros(110)
    model.weight.grad = flat[:100].view(10, 10)
    model.bias.grad = flat[100:]
    snap = MemoryLedger(model, grad_buffers=[flat]).snapshot()
    assert snap.grads == 110 * 4


def test_saved_activations_scale_with_batch_and_exclude_weights():
    torch.manual_seed(0)
    model = Transformer(model_config("tiny"))
    ledger = MemoryLedger(model)
    sizes = []
    for batch in (2, 4):
        with ledger.track_activations():
            loss = model(torch.randint(0, 256, (batch, 32))).sum()
        loss.backward()
        sizes.append(ledger.activation_bytes)
    assert sizes[0] > 0
    # everything saved is per-token activation (no weights), so doubling the batch doubles it
    assert abs(sizes[1] / sizes[0] - 2.0) < 0.05
