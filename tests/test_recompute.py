"""Activation checkpointing: the same gradients as without it, and fewer saved-activation bytes
(measured by the MemoryLedger) for full, selective and every-k-th-block modes."""

import pytest
import torch

from tessera.models import Transformer, model_config
from tessera.recompute import RecomputeConfig, apply_checkpointing, transformer_blocks
from tessera.train.memory import MemoryLedger


def run(mode: str, every: int = 1):
    """(gradients by name, saved-activation bytes) of one forward/backward of a 4-block model."""
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128))
    changed = apply_checkpointing(transformer_blocks(model), RecomputeConfig(mode=mode, every=every))
    assert len(changed) == (0 if mode == "none" else -(-4 // every))
    ledger = MemoryLedger(model)
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    with ledger.track_activations():
        logits = model(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, ledger.activation_bytes


def test_checkpointing_keeps_gradients_and_saves_activation_memory():
    ref_grads, none = run("none")
    sizes = {}
    for mode, every in (("full", 1), ("selective", 1), ("full", 2)):
        grads, sizes[(mode, every)] = run(mode, every)
        for name, g in ref_grads.items():  # recomputation repeats the same ops: bit-identical
            torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)
    print(f"\nsaved activation bytes: none {none}, " + ", ".join(f"{m} every {k}: {v}" for (m, k), v in sizes.items()))
    assert sizes[("full", 1)] < sizes[("full", 2)] < none
    assert sizes[("full", 1)] < sizes[("selective", 1)] < none


def test_checkpointing_rejects_unknown_modes():
    from tessera.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpointing.mode"):
        RecomputeConfig(mode="some").validate()
    with pytest.raises(ConfigError, match="checkpointing.every"):
        RecomputeConfig(every=0).validate()
