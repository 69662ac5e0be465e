"""tessera.hf with the Qwen2 (q/k/v biases) and Mixtral (mixture of experts) families, logit for logit.

Tiny random models are built locally by transformers (nothing is downloaded) and saved with
``save_pretrained``; one process, fp32. Import equals transformers' logits within 1e-4, export then
``from_pretrained`` equals them again, and every config a family's transformers class would compute
differently is refused with one sentence naming the field.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tessera.hf  # noqa: E402
from tessera.errors import ConfigError  # noqa: E402
from tessera.hf.config import _DEFAULTS  # noqa: E402
from tessera.hf.names import to_hf, to_tessera  # noqa: E402
from tessera.models.config import model_config  # noqa: E402
from tessera.models.llama import Transformer  # noqa: E402
from tessera.models.moe import MoEConfig  # noqa: E402

TOL = 1e-4
SHAPE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32)
CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM")}


def _hf_model(family, path, seed=0, **over):
    """A tiny random transformers model of ``family``, its biases and norm weights made non-trivial (they
    start at zeros / ones, where a dropped or swapped one would not show), saved to ``path``."""
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[family])
    torch.manual_seed(seed)
    extra = dict(num_local_experts=4, num_experts_per_tok=2) if family == "mixtral" else {}
    cfg = config_cls(**{**SHAPE, **extra, "rms_norm_eps": 1e-5, **over})
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def _tokens(vocab=61, seq=12):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


def _logits(model, tokens):
    model.eval()
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_import_matches_transformers(tmp_path, tie):
    hf = _hf_model("qwen2", tmp_path, tie_word_embeddings=tie)
    ours = tessera.hf.load(tmp_path)
    assert ours.cfg.qkv_bias and ours.moe_cfg is None
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie
    bias = ours.layers["1"].attention.wk.bias
    assert torch.equal(bias, hf.model.layers[1].self_attn.k_proj.bias) and bias.abs().max() > 0
    tokens = _tokens()
    expected = _logits(hf, tokens)
    torch.testing.assert_close(_logits(ours, tokens), expected, atol=TOL, rtol=0)
    with torch.no_grad():  # the biases matter: without them the logits move
        for layer in ours.layers.values():
            layer.attention.wq.bias.zero_()
    assert not torch.allclose(_logits(ours, tokens), expected, atol=TOL)


def test_mixtral_import_matches_transformers(tmp_path):
    hf = _hf_model("mixtral", tmp_path, router_aux_loss_coef=0.02)
    ours = tessera.hf.load(tmp_path)
    assert ours.cfg.num_experts == 4 and ours.cfg.num_moe_layers == 2
    moe = ours.moe_cfg
    assert (moe.top_k, moe.drop_tokens, moe.normalize_top_k, moe.aux_loss_coef, moe.z_loss_coef) == (
        2, False, True, 0.02, 0.0)
    assert ours.cfg.rope_theta == 1e6  # Mixtral's own default base, from rope_parameters
    tokens = _tokens(seq=16)
    torch.testing.assert_close(_logits(ours, tokens), _logits(hf, tokens), atol=TOL, rtol=0)
    # the routing really chose among the experts: more than two experts got tokens in a layer
    hidden = hf.model.embed_tokens(tokens).reshape(-1, SHAPE["hidden_size"])
    chosen = hf.model.layers[0].mlp.gate(hf.model.layers[0].input_layernorm(hidden))[2]
    assert len(chosen.unique()) > 2


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_save_then_from_pretrained_matches(tmp_path, family):
    hf = _hf_model(family, tmp_path / "in", seed=4)
    ours = tessera.hf.load(tmp_path / "in")
    with torch.no_grad():  # change the weights so the export is not the imported files over again
        ours.layers["0"].attention.wv.weight.mul_(1.5)
        if family == "qwen2":
            ours.layers["1"].attention.wq.bias.add_(0.3)
        else:
            ours.layers["1"].feed_forward.router.gate.weight.mul_(-1.0)
    tessera.hf.save(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == CLASSES[family][1]
    tokens = _tokens()
    expected = _logits(ours, tokens)
    torch.testing.assert_close(_logits(back, tokens), expected, atol=TOL, rtol=0)
    assert not torch.allclose(_logits(hf, tokens), expected, atol=TOL)  # the change is in the export
    again = tessera.hf.load(tmp_path / "out")
    torch.testing.assert_close(_logits(again, tokens), expected, atol=0, rtol=0)


def test_native_moe_model_exports_as_mixtral(tmp_path):
    """A tessera MoE model trained with capacity dropping exports; the HF model equals tessera's forward
    without dropping (module doc of tessera.hf.config)."""
    cfg = model_config("tiny", num_experts=4, moe_every=1)
    ours = Transformer(cfg, MoEConfig(top_k=2, drop_tokens=True, z_loss_coef=0.5), seed=3)
    tessera.hf.save(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    no_drop = Transformer(cfg, MoEConfig(top_k=2, drop_tokens=False), seed=3)
    tokens = _tokens(vocab=256, seq=24)
    torch.testing.assert_close(_logits(back, tokens), _logits(no_drop, tokens), atol=TOL, rtol=0)


def test_names_round_trip():
    names = ["model.layers.3.self_attn.q_proj.bias", "model.layers.0.block_sparse_moe.gate.weight",
             "model.layers.1.block_sparse_moe.experts.7.w3.weight", "model.layers.2.mlp.gate_proj.weight"]
    ours = [to_tessera(n) for n in names]
    assert ours == ["layers.3.attention.wq.bias", "layers.0.feed_forward.router.gate.weight",
                    "layers.1.feed_forward.experts.7.w3.weight", "layers.2.feed_forward.w1.weight"]
    assert [to_hf(n) for n in ours] == names
    assert to_tessera("model.layers.0.self_attn.o_proj.bias") is None  # no bias on o_proj in any family
    assert to_hf("layers.0.feed_forward.w2.bias") is None


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "mixtral"])
def test_defaults_are_transformers_class_defaults(family):
    """A field absent from config.json takes the value transformers' class gives it."""
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "mixtral": transformers.MixtralConfig}[family]
    hf = config_cls()
    for field, value in _DEFAULTS[family].items():
        if field == "rope_theta":
            assert hf.rope_parameters["rope_theta"] == value
        elif field == "num_key_value_heads" and value is None:
            assert hf.num_key_value_heads == hf.num_attention_heads
        elif field == "head_dim":  # None: hidden_size / num_attention_heads, which some classes fill in
            assert value is None and getattr(hf, "head_dim", None) in (None, hf.hidden_size // hf.num_attention_heads)
        elif field == "layer_types":  # None: derived, as tessera derives it (no sliding window by default)
            assert value is None and hf.layer_types == ["full_attention"] * hf.num_hidden_layers
        elif field == "sliding_window" and family == "qwen2":  # the class clears it unless use_sliding_window
            assert config_cls(use_sliding_window=True).sliding_window == value
        else:
            assert getattr(hf, field) == value, field


REFUSED = [  # (family, field named, change to config.json)
    ("qwen2", "use_sliding_window", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                                     "layer_types": None}),
    ("qwen2", "layer_types", {"layer_types": ["full_attention", "sliding_attention"]}),
    ("qwen2", "hidden_act", {"hidden_act": "gelu"}),
    ("mixtral", "sliding_window", {"sliding_window": 8}),
    ("mixtral", "num_experts_per_tok", {"num_experts_per_tok": 1}),
    ("mixtral", "router_jitter_noise", {"router_jitter_noise": 0.01}),
    ("mixtral", "head_dim", {"head_dim": 16}),
]


@pytest.mark.parametrize("family,field,change", REFUSED, ids=[f"{a}-{b}" for a, b, _ in REFUSED])
def test_unsupported_config_field_is_refused(tmp_path, family, field, change):
    _hf_model(family, tmp_path)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    with pytest.raises(ConfigError) as err:
        tessera.hf.load(tmp_path)
    message = str(err.value)
    assert f"'{field}'" in message and message.count(". ") == 0 and "\n" not in message


def test_sliding_window_beyond_the_last_layer_is_full_attention(tmp_path):
    """Qwen2 slides only from layer max_window_layers on: past the last layer it is plain attention, which
    transformers and tessera compute alike."""
    hf = _hf_model("qwen2", tmp_path, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert hf.config.layer_types == ["full_attention"] * 2
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]  # decided from use_sliding_window / max_window_layers alone
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens = _tokens()
    torch.testing.assert_close(_logits(tessera.hf.load(tmp_path), tokens), _logits(hf, tokens), atol=TOL, rtol=0)


EXPORT_REFUSED = [  # (field named, model fields, MoEConfig fields)
    ("model.moe_every", dict(num_experts=4, moe_every=2), {}),
    ("model.qkv_bias", dict(num_experts=4, moe_every=1, qkv_bias=True), {}),
    ("moe.top_k", dict(num_experts=4, moe_every=1), dict(top_k=1)),
    ("moe.normalize_top_k", dict(num_experts=4, moe_every=1), dict(normalize_top_k=False)),
    ("moe.use_residual", dict(num_experts=4, moe_every=1), dict(use_residual=True)),
    ("moe.num_shared_experts", dict(num_experts=4, moe_every=1), dict(num_shared_experts=1)),
]


@pytest.mark.parametrize("field,model,moe", EXPORT_REFUSED, ids=[f for f, _, _ in EXPORT_REFUSED])
def test_export_without_a_family_is_refused(field, model, moe):
    with pytest.raises(ConfigError) as err:
        tessera.hf.to_hf_config(model_config("tiny", **model), MoEConfig(**moe))
    assert f"'{field}'" in str(err.value) and "\n" not in str(err.value)
