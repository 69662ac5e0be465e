"""Megatron 1D tensor parallelism (+ sequence parallelism) against one process on the same batch."""

import pytest
import torch

from tessera.errors import ConfigError
from tessera.grad_norm import clip_grad_norm
from tessera.models import Transformer, cross_entropy_sum, model_config
from tessera.recompute import RecomputeConfig, apply_checkpointing, transformer_blocks
from tessera.tensor_parallel import (
    TensorParallelConfig,
    TensorParallelDropout,
    TensorParallelLoss,
    TensorParallelRNG,
    apply_tensor_parallel,
    gather_logits,
    is_sharded,
)
from tessera.topology import ParallelConfig, Topology
from tolerance import ADAM_EPS

BATCH, SEQ, STEPS, VOCAB = 4, 16, 3, 251  # an odd vocabulary: padded to 252 for tp = 2 and 4
LR = 1e-2


def make_model(dropout: float = 0.0) -> Transformer:
    torch.manual_seed(0)
    return Transformer(model_config("tiny", vocab_size=VOCAB, n_heads=8, n_kv_heads=4, dropout=dropout))


def batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    y = x[:, 1:].clone()
    y[0, :3] = -100  # some ignored targets
    return x[:, :-1], y


def train(model, loss_fn, steps=STEPS):
    """AdamW steps on the global-mean token loss; the loss, gradients after step 0, final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    losses, grads = [], None
    for step in range(steps):
        x, y = batch(step)
        s, n = loss_fn(model(x), y)
        (s / n).backward()
        losses.append(float(s.detach()) / n)
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            if hasattr(model, "tensor_parallel"):  # split weights over tp, the rest replicated; 0: measure only
                norm = clip_grad_norm(model.parameters(), {"tp": model.tensor_parallel[0]}, 0.0,
                                      axes_of=lambda p: ("tp",) if is_sharded(p) else ())
            else:
                norm = float(torch.cat([g.flatten() for g in grads.values()]).norm())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "norm": norm,
            "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


def tp_worker(rank, world_size, sp, recompute=False):
    topo = Topology.build(ParallelConfig(tp=world_size))
    try:
        tp = topo.group("tp")
        cfg = TensorParallelConfig(sequence_parallel=sp, recompute_core_attention=recompute)
        model = apply_tensor_parallel(make_model(), tp, cfg)
        with torch.no_grad():
            logits = gather_logits(model(batch(0)[0]), tp, VOCAB)  # before any step
        return {**train(model, TensorParallelLoss(tp)), "logits": logits}
    finally:
        topo.destroy()


def assemble(dense: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor:
    """The dense tensor from per-rank pieces: replicated pieces must agree; split ones are concatenated
    along the dimension whose size differs and trimmed (vocabulary padding)."""
    if shards[0].shape == dense.shape:
        for s in shards[1:]:
            torch.testing.assert_close(s, shards[0], rtol=0, atol=0)
        return shards[0]
    dim = next(d for d in range(dense.dim()) if shards[0].shape[d] != dense.shape[d])
    return torch.cat(shards, dim=dim).narrow(dim, 0, dense.shape[dim])


@pytest.mark.parametrize("sp,recompute", [(False, False), (True, False), (True, True)],
                         ids=["no_sp", "sp", "sp_selective_recompute"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_process(rank_pool, tp, sp, recompute):
    ref = train(make_model(), cross_entropy_sum)
    outs = rank_pool.run(tp_worker, tp, sp=sp, recompute=recompute)
    for out in outs:
        torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert out["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    model = make_model()
    with torch.no_grad():
        torch.testing.assert_close(outs[0]["logits"], model(batch(0)[0]), rtol=1e-5, atol=1e-5)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(assemble(g, [o["grads"][name] for o in outs]), g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")
    # after 3 AdamW steps at lr 1e-2 a near-zero gradient's summation-order noise moves its element by up to
    # lr per step, and the orders differ: sequence parallelism reduce-scatters (gloo: the ranks' partial sums
    # added in rank order) where plain tp all-reduces (gloo's own order); at tp = 4 that left up to 4 of 2048
    # elements of a weight beyond rtol 1e-4 (measured: at most 8e-5 apart). So every element within 1/50 of
    # one step (2e-4); a wrong row or block would be off by the whole update (1e-2 a step) or its initial value
    for name, p in ref["params"].items():
        torch.testing.assert_close(assemble(p, [o["params"][name] for o in outs]), p, rtol=0, atol=LR / 50,
                                   msg=lambda m, n=name: f"parameter {n}: {m}")
    for o in outs:  # vocabulary padding rows never get a gradient, so they stay zero
        assert o["grads"]["output.weight"].shape[0] * tp == 252


def dropout_worker(rank, world_size, sp):
    topo = Topology.build(ParallelConfig(tp=world_size))
    try:
        tp = topo.group("tp")
        torch.manual_seed(0)  # the dropout seeds come from the global RNG, seeded alike on tp ranks
        rng = TensorParallelRNG(tp, seed=7)
        ones = torch.ones(64, 64)
        masks = {k: TensorParallelDropout(0.5, rng, k)(ones) for k in ("replicated", "split")}
        x, y = batch(0)
        runs = []
        for recompute in ("none", "core", "block"):  # recomputation must replay the same dropout masks
            cfg = TensorParallelConfig(sequence_parallel=sp, recompute_core_attention=recompute == "core")
            model = apply_tensor_parallel(make_model(dropout=0.2), tp, cfg)
            if recompute == "block":
                apply_checkpointing(transformer_blocks(model), RecomputeConfig(mode="full"))
            seen = {}
            model.layers["0"].register_forward_hook(lambda m, a, out: seen.__setitem__("h", out.detach()))
            s, n = TensorParallelLoss(tp)(model(x), y)
            (s / n).backward()
            runs.append({"h": seen["h"], "loss": float(s.detach()),
                         "grads": {k: p.grad.clone() for k, p in model.named_parameters()}})
        for run in runs[1:]:
            for k, g in runs[0]["grads"].items():
                torch.testing.assert_close(run["grads"][k], g, rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
        return {"masks": masks, **runs[0]}
    finally:
        topo.destroy()


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_tp_dropout_streams(rank_pool, sp):
    """Masks agree across tp ranks where activations are replicated and differ where they are split;
    recomputing the attention core or whole blocks replays the same dropout masks (same gradients)."""
    outs = rank_pool.run(dropout_worker, 2, sp=sp)
    a, b = outs
    assert torch.equal(a["masks"]["replicated"], b["masks"]["replicated"])
    assert not torch.equal(a["masks"]["split"], b["masks"]["split"])
    assert a["loss"] == b["loss"] and torch.isfinite(torch.tensor(a["loss"]))
    if sp:  # each rank holds its own half of the sequence
        assert a["h"].shape[1] == SEQ // 2 and not torch.equal(a["h"], b["h"])
    else:  # the residual stream after a block (with dropout on) is still identical on both ranks
        assert torch.equal(a["h"], b["h"])


def test_tp_must_divide_heads():
    cfg = model_config("tiny", n_heads=8, n_kv_heads=4)
    with pytest.raises(ConfigError, match="parallel.tp=3 must divide the model's n_heads"):
        TensorParallelConfig().validate(3, cfg)
    with pytest.raises(ConfigError, match="sequence length 18"):
        TensorParallelConfig(sequence_parallel=True).validate(4, cfg, seq_len=18)
    TensorParallelConfig(sequence_parallel=True).validate(4, cfg, seq_len=16)


def checkpoint_worker(rank, world_size, sp, mode):
    topo = Topology.build(ParallelConfig(tp=world_size))
    try:
        tp = topo.group("tp")
        model = apply_tensor_parallel(make_model(), tp, TensorParallelConfig(sequence_parallel=sp))
        apply_checkpointing(transformer_blocks(model), RecomputeConfig(mode=mode))
        return train(model, TensorParallelLoss(tp), steps=2)
    finally:
        topo.destroy()


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_tp_composes_with_activation_checkpointing(rank_pool, sp, mode):
    """Blocks checkpointed by tessera.recompute (the trainer applies it after TP) still match one process."""
    ref = train(make_model(), cross_entropy_sum, steps=2)
    outs = rank_pool.run(checkpoint_worker, 2, sp=sp, mode=mode)
    for out in outs:
        torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(assemble(g, [o["grads"][name] for o in outs]), g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")
