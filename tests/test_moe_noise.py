"""Noisy MoE gating is a function of the token: N ranks equal one process with jitter and rsample.

Each (token, column) draws a counter-based hash of (run seed, layer, the token's row in the run's sample
order, its position); data parallelism, expert parallelism and context parallelism (zig-zag chunks of
every row) therefore draw, token for token, what one process draws.
"""

import pytest
import torch

from tessera.models import Transformer, model_config
from tessera.models.moe import MoEConfig, Router, key_tokens, moe_layers
from tessera.models.moe_tokens import TokenKey, layer_index, token_uniform
from tessera.train.config import load_config, validate_config

from test_trainer import tiny_args, trainer_worker
from test_trainer_strategies import metrics, single_process_runs


def test_token_noise_depends_on_the_token_only():
    """Rows 0-3 at once equal rows 0-1 and 2-3 apart; a shard of positions equals those columns of the row;
    another layer, seed or row draws other numbers; the numbers look uniform."""
    whole = token_uniform(TokenKey(7, 1, 10), 4, 4 * 6, 3, "cpu").view(4, 6, 3)
    first = token_uniform(TokenKey(7, 1, 10), 2, 2 * 6, 3, "cpu").view(2, 6, 3)
    second = token_uniform(TokenKey(7, 1, 12), 2, 2 * 6, 3, "cpu").view(2, 6, 3)
    assert torch.equal(whole, torch.cat([first, second]))
    pos = torch.tensor([0, 1, 4, 5])  # a cp rank's zig-zag chunks of a row of 6
    shard = token_uniform(TokenKey(7, 1, 10, pos), 4, 4 * 4, 3, "cpu").view(4, 4, 3)
    assert torch.equal(shard, whole[:, pos])
    for other in (TokenKey(7, 2, 10), TokenKey(8, 1, 10), TokenKey(7, 1, 11)):
        assert not torch.equal(token_uniform(other, 4, 24, 3, "cpu"), whole.view(24, 3))
    big = token_uniform(TokenKey(0, 0, 0), 64, 64 * 64, 16, "cpu")
    assert 0 < float(big.min()) and float(big.max()) < 1
    assert float(big.mean()) == pytest.approx(0.5, abs=5e-3) and float(big.std()) == pytest.approx(12**-0.5, abs=5e-3)
    assert layer_index("module.layers.3.feed_forward", 0) == 3 and layer_index("ffn", 5) == 5


@pytest.mark.parametrize("policy", ["jitter", "rsample"])
def test_keyed_router_noise_repeats_for_the_same_tokens(policy):
    """Keyed, the same tokens get the same noise (recomputation redraws it); other rows get other noise."""
    torch.manual_seed(0)
    router = Router(16, 8, MoEConfig(top_k=2, noisy_gate_policy=policy, jitter_eps=0.5))
    x = torch.randn(64, 16)
    a, b = router(x, 4, TokenKey(0, 0, 0)), router(x, 4, TokenKey(0, 0, 0))
    assert torch.equal(a.expert_TK, b.expert_TK) and torch.equal(a.gate_TK, b.gate_TK)
    c = router(x, 4, TokenKey(0, 0, 4))
    assert not (torch.equal(a.expert_TK, c.expert_TK) and torch.equal(a.gate_TK, c.gate_TK))


def test_key_tokens_names_every_moe_layer_by_its_block():
    model = Transformer(model_config("tiny", num_experts=4, moe_every=2, n_layers=4), MoEConfig(), seed=0)
    key_tokens(model, 5, 100)
    assert [(m.token_key.seed, m.token_key.layer, m.token_key.first_row) for m in moe_layers(model)] == [
        (5, 1, 100), (5, 3, 100)]
    key_tokens(model, None)
    assert all(m.token_key is None for m in moe_layers(model))


MOE = ["--model.num_experts=4", "--model.moe_every=1", "--moe.top_k=2", "--moe.capacity_factor=1.0",
       "--moe.min_capacity=0", "--model.n_layers=2", "--checkpoint.save_final=false", "--train.log_every=1"]
POLICY = {"jitter": ["--moe.noisy_gate_policy=jitter", "--moe.jitter_eps=0.5"],
          "rsample": ["--moe.noisy_gate_policy=rsample"], "none": []}
LAYOUTS = {"dp2": [], "ep2": ["--parallel.ep=2"], "cp2": ["--parallel.cp=2"]}


def _args(out, cache, policy, name):
    return tiny_args(out, cache, steps=3, extra=[*MOE, *POLICY[policy], f"--run.name={name}"])


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    return single_process_runs(tmp_path_factory.mktemp("noise_ref"),
                               lambda out, policy: _args(out, corpus_cache, policy, policy))


def _losses(rows):
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("policy", ["jitter", "rsample"])
def test_noisy_gating_matches_single_process(rank_pool, tmp_path, corpus_cache, references, policy, layout):
    """dp2, ep2 (carved from dp2) and cp2 with noisy gating: the 3 training losses and the validation losses
    equal one process's; the noise really acts (the first loss differs from the run without it)."""
    single, ref = references(policy)
    plain = _losses(references("none")[1])
    assert _losses(ref)[0] != pytest.approx(plain[0], rel=1e-6)  # training saw the noise
    assert single["val_loss_start"] == references("none")[0]["val_loss_start"]  # evaluation did not
    args = _args(tmp_path, corpus_cache, policy, layout) + LAYOUTS[layout]
    validate_config(load_config(None, args), 2)
    results = rank_pool.run(trainer_worker, 2, args=args, timeout=600.0)
    got = _losses(metrics(tmp_path / layout))
    assert len(got) == 3
    assert got == pytest.approx(_losses(ref), rel=1e-6, abs=0)  # dp, ep: identical; cp: reduction order only
    for key in ("val_loss_start", "val_loss_end"):
        assert results[0][key] == pytest.approx(single[key], rel=1e-5), key
