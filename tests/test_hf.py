"""tessera.hf: Hugging Face Llama/Mistral import and export, checked logit for logit against transformers.

Tiny random models are built locally by transformers (nothing is downloaded); one process, fp32.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tessera.hf  # noqa: E402
from tessera.models.config import model_config  # noqa: E402
from tessera.errors import ConfigError  # noqa: E402
from tessera.models.llama import Transformer  # noqa: E402

TOL = 1e-4
SHAPE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32)


def _hf_llama(tmp_path, tie=False, seed=0, **over):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**SHAPE, "tie_word_embeddings": tie, "rope_theta": 5000.0,
                                      "rms_norm_eps": 1e-5, **over})
    model = transformers.LlamaForCausalLM(cfg).eval()
    _perturb_norms(model)
    model.save_pretrained(tmp_path)
    return model


def _perturb_norms(model):
    # Norm weights start at ones: perturb them so a swapped or dropped norm would change the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))


def _tokens(vocab=61, seq=12):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _ts_logits(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("tie", [False, True])
def test_llama_import_matches_transformers(tmp_path, tie):
    hf = _hf_llama(tmp_path, tie=tie)
    ours = tessera.hf.load(tmp_path)
    assert isinstance(ours, Transformer)
    assert ours.cfg.n_kv_heads == 2 < ours.cfg.n_heads  # GQA
    assert ours.cfg.rope_theta == 5000.0 and ours.cfg.norm_eps == 1e-5
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie
    assert not any(p.is_meta for p in ours.parameters()) and not ours.rope_cos.is_meta
    tokens = _tokens()
    expected = _hf_logits(hf, tokens)
    torch.testing.assert_close(_ts_logits(ours, tokens), expected, atol=TOL, rtol=0)
    assert expected.abs().max() > 1e-2  # logits that could differ


def test_mistral_import_matches_transformers(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.MistralConfig(**SHAPE, sliding_window=None)
    hf = transformers.MistralForCausalLM(cfg).eval()
    _perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    tokens = _tokens()
    torch.testing.assert_close(_ts_logits(tessera.hf.load(tmp_path), tokens), _hf_logits(hf, tokens),
                               atol=TOL, rtol=0)


def test_sharded_safetensors_load(tmp_path):
    hf = _hf_llama(tmp_path / "a", seed=2)
    hf.save_pretrained(tmp_path / "b", max_shard_size="20KB")
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "b").glob("*.safetensors"))) > 1
    tokens = _tokens()
    torch.testing.assert_close(_ts_logits(tessera.hf.load(tmp_path / "b"), tokens), _hf_logits(hf, tokens),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_save_then_from_pretrained_matches(tmp_path, tie):
    hf = _hf_llama(tmp_path / "in", tie=tie, seed=4)
    ours = tessera.hf.load(tmp_path / "in")
    with torch.no_grad():  # change the weights so the export is not the imported files over again
        ours.layers["1"].feed_forward.w2.weight.mul_(1.5)
    tessera.hf.save(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = _tokens()
    expected = _ts_logits(ours, tokens)
    torch.testing.assert_close(_hf_logits(back, tokens), expected, atol=TOL, rtol=0)
    assert not torch.allclose(_hf_logits(hf, tokens), expected, atol=TOL)  # the change is in the export
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_save_native_tessera_model_round_trips(tmp_path):
    ours = Transformer(model_config("tiny", tie_embeddings=True), seed=7)
    tessera.hf.save(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = _tokens(vocab=256)
    torch.testing.assert_close(_hf_logits(back, tokens), _ts_logits(ours, tokens), atol=TOL, rtol=0)
    again = tessera.hf.load(tmp_path)
    torch.testing.assert_close(_ts_logits(again, tokens), _ts_logits(ours, tokens), atol=0, rtol=0)


REFUSED = [
    ("rope_scaling", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("rope_parameters.rope_type", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    ("sliding_window", {"model_type": "mistral", "sliding_window": 16}),
    ("hidden_act", {"hidden_act": "gelu"}),
    ("attention_bias", {"attention_bias": True}),
    ("mlp_bias", {"mlp_bias": True}),
    ("head_dim", {"head_dim": 16}),
    ("model_type", {"model_type": "gpt2"}),
]


@pytest.mark.parametrize("field,change", REFUSED, ids=[f for f, _ in REFUSED])
def test_unsupported_config_field_is_refused(tmp_path, field, change):
    _hf_llama(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(change)
    config_file.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        tessera.hf.load(tmp_path)
    message = str(err.value)
    assert f"'{field}'" in message and message.count(".") <= 3 and "\n" not in message
