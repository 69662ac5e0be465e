"""The single-device router and MoE feed-forward: formulas checked against hand computation."""

import math

import pytest
import torch

from tessera.errors import ConfigError
from tessera.models import Transformer, model_config
from tessera.models.moe import (
    MoEConfig,
    MoEFeedForward,
    Router,
    collect_local_stats,
    expert_capacity,
    format_stats,
    moe_loss_sum,
    validate_moe,
)


def fixed_router(weight_ED, **cfg) -> Router:
    e, d = weight_ED.shape
    router = Router(d, e, MoEConfig(**cfg))
    with torch.no_grad():
        router.gate.weight.copy_(weight_ED)
    return router


def test_aux_and_z_loss_equal_their_formulas_on_hand_computed_case():
    # logits = x (identity gate), E = 2, k = 1. Tokens choose 0, 1, 0 and 0 (a tie, lower index wins).
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.5, 0.5]])
    routing = fixed_router(torch.eye(2), top_k=1, drop_tokens=False)(x)
    assert routing.expert_TK.flatten().tolist() == [0, 1, 0, 0]
    e1, e2 = math.exp(1), math.exp(2)
    p0 = [e1 / (e1 + 1), 1 / (1 + e1), e2 / (e2 + 1), 0.5]  # probability of expert 0 per token
    P = [sum(p0) / 4, sum(1 - p for p in p0) / 4]
    f = [3 / 4, 1 / 4]
    aux = 2 * (f[0] * P[0] + f[1] * P[1])
    z = (math.log(e1 + 1) ** 2 * 2 + math.log(e2 + 1) ** 2 + math.log(2 * math.exp(0.5)) ** 2) / 4
    assert routing.aux_loss.item() == pytest.approx(aux, rel=1e-6)
    assert routing.z_loss.item() == pytest.approx(z, rel=1e-6)
    # top-1 gates are the raw probabilities (so the router is trained through them)
    assert routing.gate_TK.flatten().tolist() == pytest.approx([p0[0], 1 - p0[1], p0[2], p0[3]], rel=1e-6)


def test_uniform_routing_gives_aux_one_and_gradient_reaches_router():
    torch.manual_seed(0)
    router = fixed_router(torch.zeros(4, 8), top_k=2, drop_tokens=False)
    routing = router(torch.randn(8, 8))  # all-equal logits: every token ties, picks experts 0 and 1
    assert routing.expert_TK.tolist() == [[0, 1]] * 8
    assert routing.aux_loss.item() == pytest.approx(4 * (0.5 * 0.25 + 0.5 * 0.25))
    routing.aux_loss.backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


def test_capacity_drops_choice_major_in_token_order():
    assert expert_capacity(4, 2, 1, 1.0, 0) == 2
    assert expert_capacity(4, 2, 1, 1.0, 3) == 3  # min_capacity wins
    assert expert_capacity(4, 2, 2, 8.0, 0) == 4  # never more than the tokens
    # top-2, E = 3, T = 3, capacity = ceil(1.0·2·3/3) = 2: first choices 0,0,1; second choices 1,1,0
    w = torch.tensor([[4.0, 0.0], [0.0, 4.0], [-9.0, -9.0]])
    x = torch.tensor([[1.0, 0.5], [1.0, 0.6], [0.5, 1.0]])
    routing = fixed_router(w, top_k=2, capacity_factor=1.0, min_capacity=0)(x)
    assert routing.expert_TK.tolist() == [[0, 1], [0, 1], [1, 0]]
    # expert 0: slots for tokens 0,1 (first choices) -> token 2's second choice dropped;
    # expert 1: token 2's first choice, then token 0's second choice -> token 1's second choice dropped
    assert routing.keep_TK.tolist() == [[True, True], [True, False], [True, False]]
    assert routing.kept_E.tolist() == [2, 2, 0] and routing.dropped == 2 and routing.capacity == 2
    # normalised top-2 gates sum to one
    torch.testing.assert_close(routing.gate_TK.sum(-1), torch.ones(3))


def test_noisy_gates_only_in_training_and_change_choices():
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    for policy in ("jitter", "rsample"):
        router = Router(8, 4, MoEConfig(top_k=1, noisy_gate_policy=policy, jitter_eps=0.5))
        router.eval()
        clean = router(x).expert_TK
        router.train()
        noisy = router(x).expert_TK
        assert torch.equal(router.eval()(x).expert_TK, clean)
        assert (noisy != clean).any()



def test_rsample_draws_each_tokens_experts_from_its_probabilities():
    # Identical tokens (as early in training, when the router's inputs are nearly all alike):
    # deterministic top-k sends every one to the same experts; rsample samples the k experts without
    # replacement from p, so each expert's load follows p while the gate stays its probability.
    torch.manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    x = torch.ones(4000, 1)
    for k in (1, 2):
        router = fixed_router(p.log().unsqueeze(1), top_k=k, noisy_gate_policy="rsample", drop_tokens=False,
                              normalize_top_k=False)
        share = router(x).routed_E / 4000.0
        # chance that expert e is among k draws without replacement (k = 2: first draw or second draw)
        expect = p if k == 1 else p + torch.stack([(p * p[e] / (1 - p)).sum() - p[e] ** 2 / (1 - p[e])
                                                   for e in range(4)])
        torch.testing.assert_close(share, expect, atol=0.03, rtol=0)
        routing = router(x)
        torch.testing.assert_close(routing.gate_TK, p[routing.expert_TK])
        assert router.eval()(x).routed_E.tolist() == ([4000, 0, 0, 0] if k == 1 else [4000, 4000, 0, 0])  # no noise
    deterministic = fixed_router(p.log().unsqueeze(1), top_k=1, drop_tokens=False)
    assert deterministic(x).routed_E.tolist() == [4000, 0, 0, 0]

def dropped_output_rows(cfg: MoEConfig):
    torch.manual_seed(0)
    layer = MoEFeedForward(8, 16, 4, cfg)
    x = torch.randn(2, 16, 8)
    routing = layer.router(x.reshape(-1, 8))
    return layer(x).reshape(-1, 8), routing


def test_moe_layer_matches_per_token_loop_and_drops_to_zero():
    y, routing = dropped_output_rows(MoEConfig(top_k=2, capacity_factor=0.5, min_capacity=0))
    assert routing.dropped > 0
    torch.manual_seed(0)
    layer = MoEFeedForward(8, 16, 4, MoEConfig(top_k=2, capacity_factor=0.5, min_capacity=0))
    x = torch.randn(2, 16, 8).reshape(-1, 8)
    expect = torch.zeros_like(x)
    for t in range(x.shape[0]):  # the definition, one token at a time
        for j in range(2):
            if routing.keep_TK[t, j]:
                e = int(routing.expert_TK[t, j])
                expect[t] += routing.gate_TK[t, j] * layer.experts[e](x[t : t + 1])[0]
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-6)
    fully_dropped = (~routing.keep_TK).all(-1)
    assert fully_dropped.any() and y[fully_dropped].abs().max() == 0  # passes through the block residual


def test_residual_moe_and_shared_experts_and_param_counts():
    moe = MoEConfig(use_residual=True, num_shared_experts=2)
    for preset, kw in [("moe-small", {}), ("tiny", dict(num_experts=4, moe_every=1)),
                       ("tiny", dict(num_experts=4, moe_every=2, tie_embeddings=True))]:
        for m in (None, moe):
            cfg = model_config(preset, **kw)
            model = Transformer(cfg, m)
            assert cfg.num_params(moe=m) == sum(p.numel() for p in model.parameters())
    model = Transformer(model_config("tiny", num_experts=4, moe_every=1), moe)
    logits = model(torch.randint(0, 256, (2, 8)))
    (logits.sum() + moe_loss_sum(model)).backward()
    layer = model.layers["0"].feed_forward
    assert layer.residual_mlp.w1.weight.grad.abs().sum() > 0 and layer.shared_experts.w2.weight.grad.abs().sum() > 0
    assert moe_loss_sum(model) == 0.0  # consumed


def test_flops_count_only_active_experts():
    dense = model_config("tiny")
    moe = model_config("tiny", num_experts=4, moe_every=1)
    # top-2 of 4 experts: each token runs 2 expert MLPs instead of 1, plus the router
    extra_per_layer = 3 * 32 * 64 + 32 * 4
    assert moe.flops_per_token(64, MoEConfig(top_k=2)) == dense.flops_per_token(64) + 6 * 2 * extra_per_layer


def test_stats_count_tokens_and_aux_weighting():
    model = Transformer(model_config("tiny", num_experts=4, moe_every=2), MoEConfig(top_k=1, capacity_factor=1.0))
    model(torch.randint(0, 256, (2, 8)))
    term = moe_loss_sum(model)
    model(torch.randint(0, 256, (1, 8)))
    stats = collect_local_stats(model)
    metrics = format_stats(stats, 4)
    assert sum(metrics["moe_tokens_per_expert"]) + metrics["moe_dropped_frac"] * 24 == pytest.approx(24)
    # the loss term of one group is (0.01·aux + 0.001·z)·T with T = 16 tokens
    layer = model.layers["1"].feed_forward
    assert term.item() > 0 and layer.stats.values.sum() == 0  # counters were reset by collect


def test_config_validation_sentences():
    with pytest.raises(ConfigError, match="must divide the number of experts 6"):
        validate_moe(MoEConfig(), num_experts=6, ep=4)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        validate_moe(MoEConfig(), num_experts=0, ep=2)
    with pytest.raises(ConfigError, match="top_k=5 exceeds"):
        validate_moe(MoEConfig(top_k=5), num_experts=4)
    with pytest.raises(ConfigError, match="noisy_gate_policy"):
        MoEConfig(noisy_gate_policy="gauss").validate()
    validate_moe(MoEConfig(), num_experts=8, ep=4)
