"""Context parallelism: ring attention, Ulysses and ring self-attention against one process.

The Show-list tests `test_<method>_matches_single_process` train the tiny transformer for a few
AdamW steps with the sequence split over cp = 2 and 4 ranks and compare losses, gradients and
parameters with the dense single-process model on the same global batch.
"""

import pytest
import torch

from tessera.comm import CommGroup, CommLedger
from tessera.context_parallel import (
    ContextParallelConfig,
    apply_context_parallel,
    make_core,
    shard_sequence,
    unshard_order,
    zigzag_positions,
)
from tessera.data_parallel import DistributedDataParallel
from tessera.errors import ConfigError
from tessera.models import Transformer, model_config
from tessera.models.layers import CausalCoreAttention
from tessera.recompute import RecomputeConfig, apply_checkpointing, transformer_blocks
from tessera.topology import ParallelConfig, Topology
from tessera.train.step import forward_backward
from tolerance import ADAM_EPS, assert_close_but_few

BATCH, SEQ, STEPS = 2, 32, 3
# 8 query heads over 4 kv heads (GQA); cp = 4 leaves Ulysses 2 query heads and 1 kv head per rank.
MODEL = dict(dim=64, n_heads=8, n_kv_heads=4, ffn_hidden_dim=96, max_seq_len=64)


# ---- pure -------------------------------------------------------------------------------------

def test_zigzag_layout_covers_the_sequence_once_with_equal_causal_work():
    for cp in (1, 2, 4):
        shards = [zigzag_positions(SEQ, r, cp) for r in range(cp)]
        assert torch.equal(torch.cat(shards).sort().values, torch.arange(SEQ))
        assert torch.equal(unshard_order(SEQ, cp), torch.cat(shards))
        # causal work of a rank = Σ over its queries of (position + 1) keys: equal on every rank
        work = {int((s + 1).sum()) for s in shards}
        assert len(work) == 1, work
    x = torch.arange(2 * SEQ).view(2, SEQ)
    cp2 = CommGroup("cp", None, (0, 1), 1)  # rank 1 of 2 (no process group needed to slice)
    assert shard_sequence(x, cp2)[0].tolist() == list(range(8, 16)) + list(range(16, 24))


def test_config_validation_sentences():
    with pytest.raises(ConfigError, match="method must be one of"):
        ContextParallelConfig(method="ringg").validate()
    with pytest.raises(ConfigError, match="divisible by 2·cp = 8"):
        ContextParallelConfig("ring").check_shapes(cp=4, seq_len=36, n_heads=8, n_kv_heads=4)
    with pytest.raises(ConfigError, match="Ulysses .* divide both"):
        ContextParallelConfig("ulysses").check_shapes(cp=4, seq_len=32, n_heads=8, n_kv_heads=2)
    with pytest.raises(ConfigError, match="dropout 0"):
        ContextParallelConfig("ring").check_shapes(cp=2, seq_len=32, n_heads=8, n_kv_heads=4, dropout=0.1)
    ContextParallelConfig("ulysses").check_shapes(cp=4, seq_len=32, n_heads=8, n_kv_heads=4)
    ContextParallelConfig("ring").check_shapes(cp=4, seq_len=32, n_heads=8, n_kv_heads=2)


def test_apply_rejects_what_it_cannot_split_and_leaves_cp1_alone():
    fake_cp4 = CommGroup("cp", None, (0, 1, 2, 3), 0)  # layout only: no message is sent here
    with pytest.raises(ConfigError, match="Ulysses"):
        apply_context_parallel(Transformer(model_config("tiny", **{**MODEL, "n_kv_heads": 2})),
                               fake_cp4, ContextParallelConfig("ulysses"))
    with pytest.raises(ConfigError, match="dropout 0"):
        apply_context_parallel(Transformer(model_config("tiny", **MODEL, dropout=0.1)),
                               fake_cp4, ContextParallelConfig("ring"))
    model = Transformer(model_config("tiny", **MODEL))
    apply_context_parallel(model, CommGroup.single("cp"), ContextParallelConfig("ring"))
    assert isinstance(model.layers["0"].attention.core_attention, CausalCoreAttention)


# ---- the attention core alone -----------------------------------------------------------------

def _qkv_dout(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, SEQ, 8, 16, generator=g)
    k, v = (torch.randn(BATCH, SEQ, 4, 16, generator=g) for _ in range(2))
    return q, k, v, torch.randn(BATCH, SEQ, 8, 16, generator=g)


def core_worker(rank, world_size, method, dtype=torch.float32):
    topo = Topology.build(ParallelConfig(cp=world_size))
    try:
        cp = topo.group("cp")
        q, k, v, dout = (shard_sequence(t, cp).to(dtype) for t in _qkv_dout())
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        y = make_core(method, cp, CausalCoreAttention())(q, k, v)
        y.backward(dout)
        return {"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                "sent": topo.ledger.total("cp", "send").bytes}
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "ulysses", "ring_self_attention"])
def test_core_attention_matches_dense(rank_pool, method, cp):
    q, k, v, dout = _qkv_dout()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = CausalCoreAttention()(q, k, v)
    y.backward(dout)
    results = rank_pool.run(core_worker, cp, method=method)
    for name, ref in {"y": y, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        # reassemble the sequence from the ranks' zig-zag shards
        got = torch.empty_like(ref)
        got[:, unshard_order(SEQ, cp)] = torch.cat([r[name] for r in results], dim=1)
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{method} {n}: {m}")


@pytest.mark.multirank
def test_ring_attention_in_bfloat16(rank_pool):
    """bf16 q/k/v travel in bf16 and come back as bf16 gradients; the math runs in float32, so the
    result is the float32 attention of the bf16-rounded inputs, rounded once to bf16."""
    q, k, v, dout = (t.bfloat16().float() for t in _qkv_dout())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = CausalCoreAttention()(q, k, v)
    y.backward(dout)
    results = rank_pool.run(core_worker, 2, method="ring", dtype=torch.bfloat16)
    for name, ref in {"y": y, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        assert all(r[name].dtype == torch.bfloat16 for r in results)
        got = torch.empty_like(ref)
        got[:, unshard_order(SEQ, 2)] = torch.cat([r[name].float() for r in results], dim=1)
        torch.testing.assert_close(got, ref.detach(), rtol=1e-2, atol=1e-2, msg=lambda m, n=name: f"{n}: {m}")
    block = 2 * BATCH * (SEQ // 2) * 4 * 16  # k and v elements of one rank: 2·B·L·K·E
    # k/v once forward and once backward in bf16 (2 bytes), the dk/dv accumulator twice in float32
    assert results[0]["sent"] == block * 2 + block * 2 + 2 * block * 4


# ---- the whole model, trained -----------------------------------------------------------------

def make_model():
    torch.manual_seed(0)
    return Transformer(model_config("tiny", **MODEL))


def global_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train(model, reduce_group: CommGroup, shard, dp_rank: int = 0, dp_size: int = 1):
    """STEPS AdamW steps; per step the loss and (a copy of) every gradient, then the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAM_EPS)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    losses, grads = [], []
    for step in range(STEPS):
        x, y = global_batch(step)
        per = BATCH // dp_size
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        losses.append(forward_backward(model, [(shard(x), shard(y))], reduce_group, torch.device("cpu")).loss)
        grads.append({n: p.grad.clone() for n, p in inner.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: p.detach().clone() for n, p in inner.named_parameters()}


def cp_model_worker(rank, world_size, method, dp, recompute="none"):
    ledger = CommLedger()
    topo = Topology.build(ParallelConfig(dp_replicate=dp, cp=world_size // dp), ledger)
    try:
        cp, dp_cp = topo.group("cp"), topo.group("dp_cp")
        model = apply_context_parallel(make_model(), cp, ContextParallelConfig(method))
        if recompute != "none":  # the order of parallelize: context parallel, then checkpointing
            apply_checkpointing(transformer_blocks(model), RecomputeConfig(recompute))
        # cp-replicated parameters: gradients summed over dp × cp; loss divided by the dp × cp token count
        model = DistributedDataParallel(model, dp_cp, reduce_op="sum")
        losses, grads, params = train(model, dp_cp, lambda t: shard_sequence(t, cp), topo.coord("dp"), dp)
        ops = {op: stat.count for (axis, op), stat in ledger.stats().items() if axis == "cp"}
        sent = ledger.total("cp", "send").bytes
        return {"losses": losses, "grads": grads, "params": params, "cp_ops": ops, "cp_sent": sent}
    finally:
        topo.destroy()


def _check_against_dense(rank_pool, method, world, dp=1, recompute="none"):
    ref_losses, ref_grads, ref_params = train(make_model(), CommGroup.single("dp"), lambda t: t)
    results = rank_pool.run(cp_model_worker, world, method=method, dp=dp, recompute=recompute)
    for r in results:
        # only the summation order of the softmax and of the gradient reductions differs
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-6, atol=1e-6)
        for step, ref in enumerate(ref_grads):
            for name, g in ref.items():  # after step 0, a few near-zero-gradient parameters moved apart
                if step == 0:
                    torch.testing.assert_close(r["grads"][0][name], g, rtol=1e-4, atol=1e-6, msg=f"step 0 grad {name}")
                else:
                    # one moved parameter touches the gradients of its row and column: allow 0.5% (a wrong
                    # row of the smallest matrix here, 64 × 64, would be 1.6%)
                    assert_close_but_few(r["grads"][step][name], g, rtol=1e-4, atol=1e-6, loose_atol=1e-3,
                                         share=5e-3, msg=f"step {step} grad {name}")
        # Adam divides by sqrt(v) + eps: where a gradient entry is ~0 its summation noise becomes an update
        # difference (tests/tolerance.py)
        for name, p in ref_params.items():
            assert_close_but_few(r["params"][name], p, rtol=1e-5, atol=5e-5, loose_atol=2e-2 * STEPS, msg=name)
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_single_process(rank_pool, cp):
    results = _check_against_dense(rank_pool, "ring", cp)
    # forward cp−1 k/v shifts, backward cp−1 k/v + cp dk/dv shifts, per layer per step
    per_step = 2 * ((cp - 1) + (cp - 1) + cp)
    assert results[0]["cp_ops"]["send"] == STEPS * per_step
    # each message is one k/v (or dk/dv) block: 2 · B · S/cp · K · E fp32 values
    block = 2 * BATCH * (SEQ // cp) * MODEL["n_kv_heads"] * (MODEL["dim"] // MODEL["n_heads"]) * 4
    assert results[0]["cp_sent"] == STEPS * per_step * block


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_matches_single_process(rank_pool, cp):
    results = _check_against_dense(rank_pool, "ulysses", cp)
    assert results[0]["cp_ops"]["all_to_all"] == STEPS * 2 * (4 + 4)  # 4 fwd + 4 bwd per layer
    assert "send" not in results[0]["cp_ops"]


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_self_attention_matches_single_process(rank_pool, cp):
    results = _check_against_dense(rank_pool, "ring_self_attention", cp)
    assert results[0]["cp_ops"]["send"] == STEPS * 2 * 4 * (cp - 1)  # k, v, dk, dv shifts per layer


@pytest.mark.multirank
def test_ring_attention_composes_with_data_parallel(rank_pool):
    _check_against_dense(rank_pool, "ring", 4, dp=2)  # dp = 2 × cp = 2


@pytest.mark.multirank
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_ring_attention_with_activation_checkpointing(rank_pool, recompute):
    results = _check_against_dense(rank_pool, "ring", 2, recompute=recompute)
    if recompute == "full":  # the recomputed forward shifts k/v round the ring once more
        assert results[0]["cp_ops"]["send"] == STEPS * 2 * (3 * (2 - 1) + 2)
