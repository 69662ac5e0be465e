"""MoE as DeepSpeed configures it: residual MoE and shared experts under expert parallelism (ep2, ep2 × dp2)
equal one process; a user-supplied expert module (copied per expert, or a factory called per expert) at ep2
equals one process; noisy gating from the command line changes training, never evaluation."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tessera.cli import main
from tessera.comm import CommGroup
from tessera.errors import ConfigError
from tessera.models import Transformer, model_config
from tessera.models.moe import MoEConfig, MoEFeedForward, Router, expert_copies, use_experts
from tessera.moe import ExpertDataParallel, apply_expert_parallel
from tessera.topology import ParallelConfig, Topology

from test_moe_ep import EXPERTS, train

VARIANTS = {  # name -> (MoEConfig overrides, user expert kind)
    "residual": (dict(use_residual=True), None),
    "shared": (dict(num_shared_experts=1), None),
    "residual+shared": (dict(use_residual=True, num_shared_experts=1), None),
    "custom-copy": ({}, "copy"),
    "custom-factory": ({}, "factory"),
}


class GeluMLP(nn.Module):
    """A user's expert: [T, D] -> [T, D] through a GELU MLP of 24 hidden units."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 24), nn.Linear(24, dim)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


def make_model(variant: str) -> Transformer:
    overrides, expert = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = model_config("tiny", num_experts=EXPERTS, moe_every=1)
    model = Transformer(cfg, MoEConfig(top_k=2, capacity_factor=1.0, min_capacity=0, **overrides))
    if expert == "copy":
        use_experts(model, GeluMLP(cfg.dim))
    elif expert == "factory":
        use_experts(model, lambda: GeluMLP(cfg.dim))
    return model


def worker(rank, world_size, ep, variant):
    topo = Topology.build(ParallelConfig(dp_replicate=world_size, ep=ep))
    try:
        inner = apply_expert_parallel(make_model(variant), topo.group("ep"))
        model = ExpertDataParallel(inner, topo.group("dp"), topo.group("edp"))
        out = train(model, inner, topo.group("dp"), topo.group("ep"), rank, world_size, accum=1)
        out["local_experts"] = [type(e).__name__ for e in inner.layers["0"].feed_forward.experts]
        return out
    finally:
        topo.destroy()


@pytest.mark.multirank
@pytest.mark.parametrize("variant, world, ep", [
    ("residual", 2, 2), ("shared", 2, 2), ("residual+shared", 4, 2), ("custom-copy", 2, 2),
    ("custom-factory", 2, 2)])
def test_deepspeed_style_moe_under_ep_matches_single_process(rank_pool, variant, world, ep):
    """Losses, every gradient (experts and the replicated residual MLP, its coefficient and the shared
    experts, reduced over dp) and the parameters after 3 SGD steps equal one process's."""
    model = make_model(variant)
    ref = train(model, model, CommGroup.single("dp"), CommGroup.single("ep"), 0, 1, accum=world)
    dense = [n for n in ref["grads"] if "residual" in n or "shared_experts" in n]
    assert bool(dense) == (variant not in ("custom-copy", "custom-factory"))
    results = rank_pool.run(worker, world, ep=ep, variant=variant)
    for r in results:
        assert len(r["local_experts"]) == EXPERTS // ep
        torch.testing.assert_close(r["ce"], ref["ce"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["total"], ref["total"], rtol=1e-6, atol=1e-6)
        for name, value in r["grads"].items():
            torch.testing.assert_close(value, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert all(n in r["grads"] for n in dense)  # every rank holds the replicated parts
    assert {n for r in results for n in r["grads"]} == set(ref["grads"])
    if variant.startswith("custom"):
        assert results[0]["local_experts"] == ["GeluMLP"] * (EXPERTS // ep)


def test_user_expert_initial_values():
    """A module is copied (every expert starts from its values, DeepSpeed's rule); a factory is called once
    per expert (each its own draw); anything else is refused."""
    torch.manual_seed(0)
    given = GeluMLP(8)
    copies = expert_copies(given, 3)
    assert all(torch.equal(e.up.weight, given.up.weight) and e.up.weight is not given.up.weight for e in copies)
    made = expert_copies(lambda: GeluMLP(8), 2)
    assert not torch.equal(made[0].up.weight, made[1].up.weight)
    layer = MoEFeedForward(8, 16, 4, MoEConfig(), expert=given)
    x = torch.randn(2, 5, 8)
    assert layer(x).shape == x.shape and isinstance(layer.experts[3], GeluMLP)
    with pytest.raises(ConfigError, match="nn.Module"):
        expert_copies(3, 2)
    with pytest.raises(ConfigError, match="factory"):
        expert_copies(lambda: 3, 2)


@pytest.mark.parametrize("policy", ["jitter", "rsample"])
def test_noisy_gates_act_in_training_only(policy):
    """The router's noise changes its choices or gates in training mode and never in eval mode."""
    torch.manual_seed(0)
    router = Router(16, 8, MoEConfig(top_k=2, noisy_gate_policy=policy, jitter_eps=0.5))
    x = torch.randn(64, 16)
    a, b = router(x), router(x)
    assert not (torch.equal(a.expert_TK, b.expert_TK) and torch.equal(a.gate_TK, b.gate_TK))
    router.eval()
    c, d = router(x), router(x)
    assert torch.equal(c.expert_TK, d.expert_TK) and torch.equal(c.gate_TK, d.gate_TK)


def _train_cli(tmp_path, name, policy):
    texts = tmp_path / "texts"
    if not texts.exists():
        texts.mkdir()
        for i in range(6):
            (texts / f"t{i}.txt").write_text(f"document {i} " * 40 + "\n", encoding="utf-8")
    args = ["train", "--nproc", "1", "--model.preset=moe-small", "--model.n_layers=2", "--model.dim=32",
            "--model.n_heads=2", "--model.n_kv_heads=2", "--model.num_experts=4", f"--data.corpus={texts}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.seq_len=32", "--data.global_batch_size=4",
            "--data.micro_batch_size=2", "--data.eval_batches=1", "--train.steps=2", "--train.log_every=1",
            "--train.eval_every=2", "--run.progress=false", f"--run.out_dir={tmp_path / 'runs'}",
            f"--run.name={name}", "--checkpoint.save_final=false"]
    if policy != "none":
        args += [f"--moe.noisy_gate_policy={policy}", "--moe.jitter_eps=0.5"] if policy == "jitter" else \
            [f"--moe.noisy_gate_policy={policy}"]
    assert main(args) == 0
    lines = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
    return [r["loss"] for r in lines if r["kind"] == "train"], summary["val_loss_start"]


@pytest.mark.slow
def test_noisy_gating_from_the_command_line(tmp_path):
    """``tessera train --moe.noisy_gate_policy=jitter|rsample`` trains end to end; the same seeds without
    noise give another first training loss (the noise acts in training) and the same validation loss
    before training (evaluation has none)."""
    plain, val_plain = _train_cli(tmp_path, "none", "none")
    for policy in ("jitter", "rsample"):
        noisy, val_noisy = _train_cli(tmp_path, policy, policy)
        assert len(noisy) == 2 and all(v == v for v in noisy)  # finite, two steps
        assert noisy[0] != plain[0], policy
        assert val_noisy == val_plain, policy
