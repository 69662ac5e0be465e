"""Hugging Face Llama/Mistral ``config.json`` <-> tessera ``ModelConfig``, refusing what tessera lacks.

tessera's decoder is exactly HF's ``LlamaForCausalLM`` without options: rotate-half RoPE with base
``rope_theta`` and no scaling, RMSNorm (float32, eps inside the square root, weight after the cast back),
SwiGLU with SiLU, no biases, head dim = hidden / heads, full causal attention. A config that asks for
anything else is refused with one sentence naming the field, never imported approximately.
"""

from __future__ import annotations

from typing import Any

from tessera.errors import ConfigError
from tessera.models.config import ModelConfig

MODEL_TYPES = ("llama", "mistral")
_EXACT = "tessera implements the llama/mistral decoder without it"


def _refuse(field: str, value: Any, what: str) -> ConfigError:
    return ConfigError(f"Hugging Face config field '{field}' is {value!r} ({what}), and {_EXACT}.")


def _rope_theta(hf: dict) -> float:
    """The RoPE base, from the legacy top-level keys or transformers 5's ``rope_parameters``."""
    if hf.get("rope_scaling") is not None:
        raise _refuse("rope_scaling", hf["rope_scaling"], "a rescaled rotary embedding")
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _refuse("rope_parameters.rope_type", rope_type, "a rescaled rotary embedding")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _check_supported(hf: dict) -> None:
    """Raise ConfigError (one sentence naming the field) for anything tessera does not compute exactly."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _refuse("model_type", model_type, "another architecture")
    if hf.get("sliding_window") is not None:
        raise _refuse("sliding_window", hf["sliding_window"], "sliding-window attention")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "an activation other than SiLU")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise _refuse(field, hf[field], "biases on the projections")
    if hf.get("quantization_config") is not None:
        raise _refuse("quantization_config", "set", "quantized weights")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hf["hidden_size"] // hf["num_attention_heads"]:
        raise _refuse("head_dim", head_dim, "a head width other than hidden_size / num_attention_heads")


def from_hf_config(hf: dict) -> ModelConfig:
    """The tessera ModelConfig of an HF Llama/Mistral config dict (``config.json``); ConfigError if refused."""
    _check_supported(hf)
    try:
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=int(hf["num_attention_heads"]),
            n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            ffn_hidden_dim=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            rope_theta=_rope_theta(hf),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    except KeyError as missing:
        raise ConfigError(f"Hugging Face config lacks the field {missing.args[0]!r}.") from None
    return cfg.validate()


def to_hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """The ``config.json`` dict of a LlamaForCausalLM equal to a dense tessera model of ``cfg``."""
    if cfg.num_experts:
        raise ConfigError(
            f"Model field 'num_experts' is {cfg.num_experts}; Hugging Face Llama export needs a dense model."
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers < 5 reads the top-level key, 5 reads rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "use_cache": True,
    }
