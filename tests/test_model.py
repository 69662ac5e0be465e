"""Pure-tier tests of the single-device reference model (fast: whole file a few seconds).

Legend: B batch, S sequence, D model dim, H heads, E head dim, V vocab.
"""

from __future__ import annotations

import ast
import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tessera.models
from tessera.errors import ConfigError
from tessera.models import PRESETS, ModelConfig, Transformer, cross_entropy_sum, model_config
from tessera.models.layers import Attention, apply_rope, precompute_rope
from tessera.models.moe import MoEConfig


def _tiny(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_config("tiny", **overrides))


def _tokens(b: int = 2, s: int = 16, v: int = 256, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, v, (b, s), generator=g)


# ---- shapes and counts ---------------------------------------------------------------


def test_forward_shape():
    model = _tiny()
    logits_BSV = model(_tokens(3, 20))
    assert logits_BSV.shape == (3, 20, 256)
    assert logits_BSV.dtype == torch.float32


def test_sequence_too_long_is_clear_error():
    model = _tiny()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(1, 65))


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("tied", [False, True])
def test_num_params_matches_module(preset, tied):
    cfg = model_config(preset, tie_embeddings=tied)
    model = Transformer(cfg)
    real = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == real
    emb = cfg.vocab_size * cfg.dim
    assert cfg.num_params(include_embeddings=False) == real - emb


@pytest.mark.parametrize(
    "preset,expected,tol",
    [("124M", 124e6, 0.03), ("1B", 1.24e9, 0.03), ("7B", 6.74e9, 0.02), ("70B", 69e9, 0.02)],
)
def test_large_preset_counts_analytic(preset, expected, tol):
    cfg = PRESETS[preset]  # never instantiated
    cfg.validate()
    assert abs(cfg.num_params() - expected) / expected < tol


def test_flops_per_token_formula():
    cfg = PRESETS["7B"]
    n = cfg.num_params() - cfg.vocab_size * cfg.dim  # untied: head counted, lookup not
    expected = 6 * n + 12 * cfg.n_layers * cfg.dim * 4096
    assert cfg.flops_per_token(4096) == expected
    tied = PRESETS["124M"]
    assert tied.flops_per_token(1024) == 6 * tied.num_params() + 12 * 12 * 768 * 1024


# ---- tied embeddings -----------------------------------------------------------------


def test_tied_weights_are_one_parameter_with_summed_grad():
    model = _tiny(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert "output.weight" not in names and "tok_embeddings.weight" in names
    tokens = _tokens(2, 8)
    model(tokens).sum().backward()
    grad_total = model.tok_embeddings.weight.grad.clone()

    # Untie a copy and add the two gradients by hand: the tied grad must be their sum.
    untied = _tiny(tie_embeddings=True)
    untied.output.weight = torch.nn.Parameter(untied.tok_embeddings.weight.detach().clone())
    untied(tokens).sum().backward()
    expected = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(grad_total, expected)


# ---- semantics -----------------------------------------------------------------------


def test_causality():
    model = _tiny().eval()
    tokens = _tokens(2, 24)
    t = 10
    changed = tokens.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_seed_determinism():
    a, b, c = _tiny(seed=5), _tiny(seed=5), _tiny(seed=6)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    tokens = _tokens()
    assert torch.equal(a(tokens), b(tokens))
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    assert not torch.equal(a(tokens), c(tokens))


def test_init_scales_residual_projections():
    model = Transformer(model_config("small"))
    std = model.cfg.init_std
    wo = model.layers["0"].attention.wo.weight
    wq = model.layers["0"].attention.wq.weight
    assert abs(wq.std().item() - std) < 0.1 * std
    assert abs(wo.std().item() - std / math.sqrt(2 * model.cfg.n_layers)) < 0.1 * std
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_deleting_a_layer_keeps_names_and_runs():
    model = _tiny(n_layers=3)
    del model.layers["1"]
    assert list(model.layers.keys()) == ["0", "2"]
    names = {n for n, _ in model.named_parameters()}
    assert "layers.2.attention.wq.weight" in names
    assert not any(n.startswith("layers.1.") for n in names)
    assert model(_tokens()).shape == (2, 16, 256)


def test_stage_without_embeddings_accepts_hidden_states():
    model = _tiny()
    model.tok_embeddings = None
    model.norm = None
    model.output = None
    h_BSD = torch.randn(2, 16, 32)
    out = model(h_BSD)
    assert out.shape == (2, 16, 32)


def _reference_mha(attn: Attention, x_BSD, cos, sin) -> torch.Tensor:
    """Plain matmul + softmax + causal mask multi-head attention (no SDPA, no repeat)."""
    b, s, _ = x_BSD.shape
    e = attn.head_dim
    q = apply_rope(attn.wq(x_BSD).view(b, s, -1, e), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x_BSD).view(b, s, -1, e), cos, sin).transpose(1, 2)
    v = attn.wv(x_BSD).view(b, s, -1, e).transpose(1, 2)
    scores_BHSS = q @ k.transpose(-1, -2) / math.sqrt(e)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores_BHSS = scores_BHSS.masked_fill(mask, float("-inf"))
    y = scores_BHSS.softmax(-1) @ v
    return attn.wo(y.transpose(1, 2).reshape(b, s, -1))


def test_attention_matches_reference_mha():
    torch.manual_seed(0)
    cfg = model_config("tiny", n_kv_heads=4)
    attn = Attention(cfg).eval()
    x_BSD = torch.randn(2, 12, cfg.dim)
    cos, sin = precompute_rope(cfg.head_dim, 12, cfg.rope_theta)
    torch.testing.assert_close(
        attn(x_BSD, cos, sin), _reference_mha(attn, x_BSD, cos, sin), atol=1e-5, rtol=1e-5
    )


def test_gqa_equals_mha_with_repeated_kv_weights():
    torch.manual_seed(0)
    gqa = Attention(model_config("tiny", n_kv_heads=2)).eval()
    mha = Attention(model_config("tiny", n_kv_heads=4)).eval()
    e = gqa.head_dim
    with torch.no_grad():
        for name in ("wq", "wo"):
            getattr(mha, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("wk", "wv"):
            w_KED = getattr(gqa, name).weight.view(2, e, -1)
            getattr(mha, name).weight.copy_(w_KED.repeat_interleave(2, dim=0).reshape(4 * e, -1))
    x_BSD = torch.randn(2, 10, 32)
    cos, sin = precompute_rope(e, 10)
    torch.testing.assert_close(gqa(x_BSD, cos, sin), mha(x_BSD, cos, sin), atol=1e-5, rtol=1e-5)


def test_rope_is_norm_preserving_rotation():
    cos, sin = precompute_rope(16, 32)
    x_BSHE = torch.randn(2, 32, 3, 16)
    y = apply_rope(x_BSHE, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x_BSHE.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x_BSHE[:, 0])  # position 0 is the identity


def test_rope_is_relative():
    cos, sin = precompute_rope(16, 64)
    q, k = torch.randn(16), torch.randn(16)

    def dot(m: int, n: int) -> float:
        qm = apply_rope(q.expand(1, 64, 1, 16), cos, sin)[0, m, 0]
        kn = apply_rope(k.expand(1, 64, 1, 16), cos, sin)[0, n, 0]
        return float(qm @ kn)

    assert dot(5, 2) == pytest.approx(dot(40, 37), abs=1e-4)
    assert dot(9, 9) == pytest.approx(dot(0, 0), abs=1e-4)
    assert dot(5, 2) != pytest.approx(dot(5, 3), abs=1e-3)


def test_dropout_train_vs_eval():
    model = _tiny(dropout=0.2)
    tokens = _tokens()
    model.train()
    torch.manual_seed(1)
    a = model(tokens)
    torch.manual_seed(2)
    b = model(tokens)
    assert not torch.allclose(a, b)
    model.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        c = model(tokens)
        torch.manual_seed(2)
        d = model(tokens)
    assert torch.equal(c, d)
    no_dropout = _tiny(dropout=0.0).eval()
    with torch.no_grad():
        torch.testing.assert_close(c, no_dropout(tokens))  # same seed -> same weights


def test_tiny_train_step_is_fast():
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = _tokens(8, 33)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss_sum, n = cross_entropy_sum(model(inputs), targets)
        (loss_sum / n).backward()
        opt.step()
        return loss_sum.item() / n

    first = step()  # warm-up: allocator and kernel selection
    start = time.perf_counter()
    for _ in range(3):
        last = step()
    elapsed = (time.perf_counter() - start) / 3
    assert elapsed < 1.0, f"tiny train step took {elapsed:.3f}s"
    assert last < first  # it learns
    assert first == pytest.approx(math.log(256), rel=0.1)  # small init -> near-uniform


# ---- config validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"dim": 0}, "dim"),
        ({"n_layers": -1}, "n_layers"),
        ({"dim": 30, "n_heads": 4}, "divisible by n_heads"),
        ({"n_kv_heads": 3}, "divisible by n_kv_heads"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"dim": 36, "n_heads": 4, "n_kv_heads": 2}, "even"),
    ],
)
def test_validate_errors(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        model_config("tiny", **overrides)
    msg = str(info.value)
    assert msg.endswith(".") and "\n" not in msg


def test_model_config_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="tiny"):
        model_config("huge")
    with pytest.raises(ConfigError, match="n_head"):
        model_config("tiny", n_head=3)


def test_model_config_copies_preset():
    cfg = model_config("tiny", dim=64)
    assert cfg.dim == 64 and PRESETS["tiny"].dim == 32
    assert ModelConfig() == PRESETS["small"]
    assert Transformer.from_preset("tiny", n_layers=1).cfg.n_layers == 1


# ---- loss ----------------------------------------------------------------------------


def test_cross_entropy_sum_matches_torch():
    g = torch.Generator().manual_seed(0)
    logits_BSV = torch.randn(3, 7, 11, generator=g)
    targets_BS = torch.randint(0, 11, (3, 7), generator=g)
    loss_sum, n = cross_entropy_sum(logits_BSV, targets_BS)
    expected = F.cross_entropy(logits_BSV.reshape(-1, 11), targets_BS.reshape(-1), reduction="sum")
    torch.testing.assert_close(loss_sum, expected)
    assert n == 21 and loss_sum.dtype == torch.float32 and loss_sum.dim() == 0


def test_cross_entropy_sum_ignores_tokens_and_upcasts():
    g = torch.Generator().manual_seed(0)
    logits_BSV = torch.randn(2, 5, 11, generator=g).to(torch.bfloat16)
    targets_BS = torch.randint(0, 11, (2, 5), generator=g)
    targets_BS[0, :3] = -100
    targets_BS[1, 4] = -100
    loss_sum, n = cross_entropy_sum(logits_BSV, targets_BS)
    assert n == 6 and loss_sum.dtype == torch.float32
    keep = targets_BS != -100
    expected = F.cross_entropy(logits_BSV.float()[keep], targets_BS[keep], reduction="sum")
    torch.testing.assert_close(loss_sum, expected)
    loss_sum, n = cross_entropy_sum(logits_BSV, torch.full((2, 5), 7), ignore_index=7)
    assert n == 0 and loss_sum.item() == 0.0


# ---- structure ------------------------------------------------------------------------


def _model_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of tessera.models that ``path`` imports, at top level or inside a function
    ("__init__" for the package itself); fails on any torch.distributed import."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            assert not name.startswith("torch.distributed"), f"{path.name} imports {name}"
            parts = name.split(".")
            if parts[:2] == ["tessera", "models"]:
                deps.add(parts[2] if len(parts) > 2 and parts[2] in modules else "__init__")
    return deps - {path.stem}


def test_models_import_no_cycle_and_no_distributed():
    """The single-device models form an import DAG (the block picks its feed-forward from feed_forward.py
    and moe.py, neither of which imports the block back) and never touch torch.distributed."""
    files = {f.stem: f for f in Path(tessera.models.__file__).parent.glob("*.py")}
    graph = {name: _model_imports(f, set(files)) for name, f in files.items()}
    assert "moe" in graph["layers"] and "feed_forward" in graph["moe"]  # the graph is really read
    done, path = set(), []

    def visit(name):
        assert name not in path, f"import cycle: {' -> '.join(path + [name])}"
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_feed_forward_parameter_names_are_stable():
    """Checkpoints and parity key on these names: a dense block's SwiGLU and an MoE block's router,
    experts, residual MLP and shared experts."""
    torch.manual_seed(0)
    moe = Transformer(model_config("tiny", n_layers=2, num_experts=2, moe_every=2),
                      MoEConfig(use_residual=True, num_shared_experts=1))
    names = [n for n, _ in moe.named_parameters() if ".feed_forward." in n]
    swiglu = ["w1.weight", "w3.weight", "w2.weight"]
    expected = [f"layers.0.feed_forward.{w}" for w in swiglu]
    expected += ["layers.1.feed_forward.router.gate.weight"]
    expected += [f"layers.1.feed_forward.experts.{e}.{w}" for e in range(2) for w in swiglu]
    expected += [f"layers.1.feed_forward.residual_mlp.{w}" for w in swiglu]
    expected += ["layers.1.feed_forward.residual_coef.weight"]
    expected += [f"layers.1.feed_forward.shared_experts.{w}" for w in swiglu]
    assert names == expected
