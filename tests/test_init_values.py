"""Initial values are a function of (seed, parameter name): any slice of any parameter, drawn on its own
chunk by chunk, equals the same slice of the whole parameter (tessera.models.init)."""

import pytest
import torch
from torch import nn

from tessera.models import Transformer
from tessera.models import init as init_mod
from tessera.models.config import model_config
from tessera.models.init import InitSpec, Origin, assign, materialize, origin_of


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(init_mod, "CHUNK", 1000)  # several chunks per parameter in tiny shapes


def _meta_param(spec: InitSpec) -> nn.Parameter:
    with torch.device("meta"):
        p = nn.Parameter(torch.empty(spec.shape))
    init_mod.init_parameter(p, spec)
    return p


def _meta(*shape) -> nn.Parameter:
    with torch.device("meta"):
        return nn.Parameter(torch.empty(*shape))


def _held(**params) -> nn.Module:
    m = nn.Module()
    for name, p in params.items():
        setattr(m, name, p)
    materialize(m, torch.device("cpu"))
    return m


def test_chunks_depend_on_seed_name_and_index_only(small_chunks):
    a = InitSpec("w", (30, 70), "normal", 0.02, seed=1)
    assert torch.equal(a.values(), InitSpec("w", (30, 70), "normal", 0.02, seed=1).values())
    assert not torch.equal(a.values(), InitSpec("w", (30, 70), "normal", 0.02, seed=2).values())
    assert not torch.equal(a.values(), InitSpec("v", (30, 70), "normal", 0.02, seed=1).values())
    chunks = [a.chunk(k) for k in range(3)]  # 2100 elements = chunks of 1000, 1000, 100
    assert [c.numel() for c in chunks] == [1000, 1000, 100]
    assert not torch.equal(chunks[0], chunks[1])
    assert abs(float(a.values().std()) - 0.02) < 0.002
    assert torch.equal(InitSpec("n", (5,), "ones").values(), torch.ones(5))


def test_any_flat_range_equals_the_whole(small_chunks):
    spec = InitSpec("w", (37, 90), "normal", 0.02, seed=7)
    whole = spec.values().view(-1)
    for start, n in [(0, 1), (999, 2), (1000, 1000), (123, 2500), (3329, 1)]:
        assert torch.equal(Origin(spec).fill_(torch.empty(n), start), whole[start:start + n])


def test_views_padding_and_chains_equal_the_whole_parameters_slices(small_chunks):
    spec = InitSpec("w", (37, 90), "normal", 0.02, seed=7)
    whole, p = spec.values(), _meta_param(spec)
    cols, padded, outer = _meta(37, 30), _meta(20, 90), _meta(37, 45)
    assign(cols, p.chunk(3, dim=1)[1])  # a row-parallel linear's column block
    assign(padded, p[20:37], rows=17)  # a vocabulary shard past the last real row
    assign(outer, p.chunk(2, dim=1)[1])
    inner = _meta(12, 15)
    assign(inner, outer.chunk(3, dim=0)[1][:12, 15:30])  # a block of a block
    m = _held(cols=cols, padded=padded, inner=inner)
    assert torch.equal(m.cols, whole[:, 30:60])
    assert torch.equal(m.padded[:17], whole[20:37]) and not m.padded[17:].any()
    assert torch.equal(m.inner, whole[:, 45:][13:25, 15:30])
    flat = torch.empty(500, dtype=torch.bfloat16)  # a ZeRO-3 shard of a column block, in bf16
    origin_of(outer).fill_(flat, start=700)
    assert torch.equal(flat, whole[:, 45:].reshape(-1)[700:1200].bfloat16())


def test_assign_copies_real_tensors_and_refuses_mixed_devices():
    src, dest = torch.randn(4, 6), torch.empty(4, 3)
    assign(dest, src[:, 3:])
    assert torch.equal(dest, src[:, 3:])
    dest = torch.full((3, 6), 9.0)
    assign(dest, src[2:], rows=2)
    assert torch.equal(dest[:2], src[2:]) and not dest[2:].any()
    with pytest.raises(ValueError, match="meta"):
        assign(_meta(4, 3), src[:, 3:])


def test_meta_build_equals_real_build_and_keeps_ties(small_chunks):
    cfg = model_config("tiny", tie_embeddings=True)
    real = Transformer(cfg, seed=5)
    with torch.device("meta"):
        meta = Transformer(cfg, seed=5)
    assert all(p.is_meta for p in meta.parameters())
    allocated = materialize(meta, torch.device("cpu"))
    assert allocated == sum(p.numel() * p.element_size() for p in real.parameters())
    assert meta.output.weight is meta.tok_embeddings.weight
    for (name, a), (_, b) in zip(real.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(real.state_dict()["tok_embeddings.weight"],
                           Transformer(cfg, seed=6).state_dict()["tok_embeddings.weight"])


def test_global_seed_still_decides_an_unseeded_model():
    cfg = model_config("tiny")
    torch.manual_seed(3)
    a = Transformer(cfg)
    torch.manual_seed(3)
    b = Transformer(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_init_kinds_follow_the_module():
    cfg = model_config("tiny")
    values = Transformer(cfg, seed=0).state_dict()
    assert torch.equal(values["norm.weight"], torch.ones(cfg.dim))
    std = float(values["layers.0.attention.wq.weight"].std())
    resid = float(values["layers.0.attention.wo.weight"].std())
    assert resid < 0.8 * std  # wo writes into the residual stream: init_std / sqrt(2 · n_layers)
