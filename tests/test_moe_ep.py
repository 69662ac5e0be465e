"""Expert parallelism: N gloo ranks (experts spread over ep) against one process, and the all-to-all bytes."""

import contextlib

import pytest
import torch

from tessera.comm import CommGroup
from tessera.grad_norm import clip_grad_norm
from tessera.models import Transformer, cross_entropy_sum, model_config
from tessera.models.moe import MoEConfig, MoEFeedForward, moe_loss_sum
from tessera.moe import (
    ExpertDataParallel,
    apply_expert_parallel,
    expert_parameters,
    global_expert_state,
    moe_metrics,
)
from tessera.topology import ParallelConfig, Topology

GLOBAL_BATCH, SEQ, STEPS, EXPERTS = 8, 16, 3, 4


def make_model(top_k: int, capacity_factor: float) -> Transformer:
    torch.manual_seed(0)
    cfg = model_config("tiny", num_experts=EXPERTS, moe_every=1)
    moe = MoEConfig(top_k=top_k, capacity_factor=capacity_factor, min_capacity=0, z_loss_coef=1e-2)
    return Transformer(cfg, moe)


def rank_batches(step: int, rank: int, world: int, accum: int):
    """This rank's contiguous slice of the global batch, cut into ``accum`` micro-batches."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    data = data[rank * per : (rank + 1) * per]
    return list(zip(data[:, :-1].chunk(accum), data[:, 1:].chunk(accum)))


def global_names(inner: torch.nn.Module, tensors: dict) -> dict:
    """Rename local expert entries to their global expert index (identity without expert parallelism)."""
    mapping = global_expert_state(inner)
    out = {}
    for name, value in tensors.items():
        if name in mapping:
            index, leaf = mapping[name]
            name = f"{name.split('.experts.')[0]}.experts.{index}.{leaf}"
        out[name] = value
    return out


def train(model, inner, dp: CommGroup, ep: CommGroup, rank: int, world: int, accum: int):
    """The house step: (CE sum + MoE loss sum) / global tokens per micro-batch; dp gradients summed."""
    # SGD, not Adam: Adam divides by sqrt(v), which turns the ~1e-7 relative reduction-order noise of
    # near-zero expert gradient entries into ~1e-5 parameter noise; SGD keeps the comparison tight.
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    out = {"ce": [], "total": [], "metrics": []}
    for step in range(STEPS):
        batches = rank_batches(step, rank, world, accum)
        total_tokens = torch.tensor(float(sum(y.numel() for _, y in batches)))
        dp_sum = lambda t: (torch.distributed.all_reduce(t) if dp.size > 1 else None, t)[1]  # noqa: E731
        dp_sum(total_tokens)
        sums = torch.zeros(2, dtype=torch.float64)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
                logits = model(x)
                if step == 0:
                    out.setdefault("logits", []).append(logits.detach().clone())
                ce, _ = cross_entropy_sum(logits, y)
                s = ce + moe_loss_sum(model)
                (s / total_tokens).backward()
            sums += torch.stack([ce.detach().double(), s.detach().double()])
        out["ce"].append(float(dp_sum(sums)[0] / total_tokens))
        out["total"].append(float(sums[1] / total_tokens))
        out["metrics"].append(moe_metrics(model, [dp]))
        if step == 0:
            out["grads"] = global_names(inner, {n: p.grad.clone() for n, p in inner.named_parameters()})
            experts = {id(p) for p in expert_parameters(inner)}  # split over ep; dense weights replicated
            out["grad_norm"] = clip_grad_norm(inner.parameters(), {"ep": ep}, 0.0,  # 0: measure only
                                              axes_of=lambda p: ("ep",) if id(p) in experts else ())
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = global_names(inner, {n: p.detach().clone() for n, p in inner.named_parameters()})
    return out


def ep_worker(rank, world_size, ep, top_k, capacity_factor, accum=1):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=ep))
    try:
        inner = apply_expert_parallel(make_model(top_k, capacity_factor), topo.group("ep"))
        model = ExpertDataParallel(inner, topo.group("dp"), topo.group("edp"))
        out = train(model, inner, topo.group("dp"), topo.group("ep"), rank, world_size, accum=accum)
        out["local_experts"] = len(inner.layers["0"].feed_forward.experts)
        return out
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("world,ep,accum", [(2, 2, 1), (4, 4, 1), (4, 2, 1), (2, 2, 2)])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_ep_matches_single_process(rank_pool, world, ep, accum, top_k):
    # capacity_factor 1.0 with min_capacity 0 drops tokens on these random batches (asserted below).
    # One process runs the global batch as world·accum micro-batches: the ranks' routing groups.
    model = make_model(top_k, 1.0)
    ref = train(model, model, CommGroup.single("dp"), CommGroup.single("ep"), 0, 1, accum=world * accum)
    results = rank_pool.run(ep_worker, world, ep=ep, top_k=top_k, capacity_factor=1.0, accum=accum)
    assert ref["metrics"][0]["moe_dropped_frac"] > 0.02
    for rank, r in enumerate(results):
        assert r["local_experts"] == EXPERTS // ep
        for i in range(accum):  # outputs
            torch.testing.assert_close(r["logits"][i], ref["logits"][rank * accum + i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["ce"], ref["ce"], rtol=1e-6, atol=1e-6)
        # the global gradient norm (dense once + every rank's experts) is the single-process one on all ranks
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        for key in ("moe_tokens_per_expert", "moe_dropped_frac"):  # same routing, same drops
            assert [m[key] for m in r["metrics"]] == [m[key] for m in ref["metrics"]]
        assert [m["moe_aux_loss"] for m in r["metrics"]] == pytest.approx([m["moe_aux_loss"] for m in ref["metrics"]])
        assert set(r["grads"]) <= set(ref["grads"])
        for name, value in r["grads"].items():
            torch.testing.assert_close(value, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        # the loss with the aux and z terms (each rank's sums all-reduced over dp) is the single-process one
        torch.testing.assert_close(r["total"], ref["total"], rtol=1e-6, atol=1e-6)
        assert all(t > c for t, c in zip(r["total"], r["ce"]))
    # together the ranks hold every expert (each rank only E/ep of them)
    held = {n for r in results for n in r["grads"]}
    assert held == set(ref["grads"])


def balanced_input(rank: int, tokens: int, dim: int, n_exp: int) -> torch.Tensor:
    """Token t's largest feature is t mod E and its second t+1 mod E: with an identity-like router,
    every expert receives the same number of first and second choices."""
    x = torch.zeros(tokens, dim)
    t = torch.arange(tokens)
    x[t, (t + rank) % n_exp] = 2.0
    x[t, (t + rank + 1) % n_exp] = 1.0
    return x


def ledger_worker(rank, world_size, ep, top_k, balanced):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=ep))
    try:
        tokens, dim, n_exp = 32, 8, 4
        torch.manual_seed(0)
        layer = MoEFeedForward(dim, 16, n_exp, MoEConfig(top_k=top_k, drop_tokens=False))
        if balanced:
            with torch.no_grad():
                layer.router.gate.weight.copy_(torch.eye(n_exp, dim))
            x = balanced_input(rank, tokens, dim, n_exp)
        else:
            x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(rank))
        x.requires_grad_(True)
        inner = apply_expert_parallel(torch.nn.Sequential(layer), topo.group("ep"))
        routing = inner[0].router(x)
        owner_TK = routing.expert_TK // (n_exp // ep)
        to_rank = torch.bincount(owner_TK.flatten(), minlength=ep).tolist()  # rows sent to each ep rank
        rows_away = sum(to_rank) - to_rank[topo.coord("ep")]  # rows this rank sends to other ranks
        before = topo.ledger.stats()
        y = inner(x.view(1, tokens, dim))
        fwd = topo.ledger.since(before)
        mid = topo.ledger.stats()
        y.square().sum().backward()
        bwd = topo.ledger.since(mid)
        return {"fwd": fwd[("ep", "all_to_all")].wire_bytes, "fwd_n": fwd[("ep", "all_to_all")].count,
                "bwd": bwd[("ep", "all_to_all")].wire_bytes, "bwd_n": bwd[("ep", "all_to_all")].count,
                "rows_away": rows_away, "to_rank": to_rank, "keys": sorted(set(fwd) | set(bwd)), "tokens": tokens, "dim": dim}
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4)])
@pytest.mark.parametrize("top_k", [1, 2])
def test_all_to_all_bytes_per_moe_layer(rank_pool, world, ep, top_k):
    n_exp = 4
    counts_wire = (ep - 1) * (n_exp // ep) * 8  # the [ep, E/ep] int64 count exchange
    for r in rank_pool.run(ledger_worker, world, ep=ep, top_k=top_k, balanced=True):
        # balanced routing: tokens·k rows, a share (ep-1)/ep of them owned elsewhere, fp32 rows of D
        per_direction = r["tokens"] * top_k * r["dim"] * 4 * (ep - 1) / ep
        assert r["rows_away"] * r["dim"] * 4 == per_direction
        assert r["fwd"] == 2 * per_direction + counts_wire and r["fwd_n"] == 3  # dispatch + combine + counts
        assert r["bwd"] == 2 * per_direction and r["bwd_n"] == 2  # their inverses, no counts
        assert r["keys"] == [("ep", "all_to_all")]
    # uneven routing: dispatch sends exactly the rows owned elsewhere, combine returns exactly the rows
    # received from the others, backward the same two in reverse; no capacity padding
    results = rank_pool.run(ledger_worker, world, ep=ep, top_k=top_k, balanced=False)
    for me, r in enumerate(results):
        received = sum(o["to_rank"][me] for j, o in enumerate(results) if j != me)
        assert r["fwd"] == (r["rows_away"] + received) * r["dim"] * 4 + counts_wire
        assert r["bwd"] == (r["rows_away"] + received) * r["dim"] * 4
