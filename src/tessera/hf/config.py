"""Hugging Face ``config.json`` <-> tessera ``ModelConfig`` (+ ``MoEConfig``), refusing what tessera lacks.

Four families, each exactly a tessera ``Transformer``:

- ``llama`` / ``mistral``: rotate-half RoPE with base ``rope_theta`` and no scaling, RMSNorm (float32, eps
  inside the square root, weight after the cast back), SwiGLU with SiLU, no biases, head dim = hidden /
  heads, full causal attention.
- ``qwen2``: the same with biases on the q/k/v projections (``ModelConfig.qkv_bias``). Sliding-window
  attention is refused exactly where transformers turns it on: a layer slides when ``layer_types`` says
  ``sliding_attention``; without ``layer_types``, layers ``max_window_layers`` and up slide when
  ``use_sliding_window`` is true and ``sliding_window`` is set.
- ``mixtral``: every block a mixture of experts (``moe_every=1``). Its router is tessera's
  :class:`tessera.models.moe.Router` line for line: logits = x W_gᵀ (no bias), softmax in float32, the
  top k, the k gates renormalised to sum to 1 (``normalize_top_k``); each expert is tessera's SwiGLU
  ``FeedForward`` (w1 gate, w3 up, w2 down) and the block output is Σ gate · expert(x). transformers
  never drops a token, so the import sets ``drop_tokens=False``. Refused: ``num_experts_per_tok=1``
  (transformers renormalises the single gate to 1, tessera keeps the probability) and
  ``router_jitter_noise > 0`` (transformers jitters the experts' input too, tessera only the router's).
  ``router_aux_loss_coef`` becomes ``aux_loss_coef`` and ``z_loss_coef`` is 0; the load-balancing term
  itself is tessera's (the per-layer Switch loss summed over layers; transformers averages the routing
  statistics over layers first and adds it only with ``output_router_logits``), which changes training
  losses, never the logits.

A field that a family's transformers class does not read is ignored; a field it reads with a value
tessera does not compute exactly is refused with one sentence naming it, never imported approximately.
A field absent from ``config.json`` takes the transformers 5 class default of its family (``_DEFAULTS``).

Export (:func:`to_hf_config`): a dense model is a ``LlamaForCausalLM``, or a ``Qwen2ForCausalLM`` with
q/k/v biases; an MoE model is a ``MixtralForCausalLM`` when every block is MoE with the plain top-k
router (k ≥ 2, renormalised), no residual MLP, no shared experts and no q/k/v biases. Capacity dropping
(``drop_tokens=true``, the ``[moe]`` default) has no Hugging Face counterpart and is exported anyway:
the Hugging Face model equals tessera's forward with ``drop_tokens=false`` (identical wherever no token
overflows an expert's capacity). Training-only knobs (noisy gating, z-loss, capacity factors) are dropped.
"""

from __future__ import annotations

from typing import Any

from tessera.errors import ConfigError
from tessera.models.config import ModelConfig
from tessera.models.moe import MoEConfig, validate_moe

MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
_COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-6, "num_key_value_heads": None, "head_dim": None}
# transformers 5 config-class defaults of the fields tessera reads (tests compare them with the classes)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_COMMON, "max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {**_COMMON, "max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
              "use_sliding_window": False, "max_window_layers": 28, "layer_types": None},
    "mixtral": {**_COMMON, "max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                "sliding_window": None, "rope_theta": 1e6, "num_experts_per_tok": 2, "num_local_experts": 8, "router_aux_loss_coef": 0.001,
                "router_jitter_noise": 0.0},
}


def _refuse(field: str, value: Any, what: str) -> ConfigError:
    return ConfigError(f"Hugging Face config field '{field}' is {value!r} ({what}), "
                       f"which tessera does not compute exactly.")


def _get(hf: dict, field: str) -> Any:
    """``hf[field]``, or the family's transformers default when ``config.json`` leaves it out."""
    return hf[field] if field in hf else _DEFAULTS[hf["model_type"]][field]


def _rope_theta(hf: dict) -> float:
    """The RoPE base, from the legacy top-level key or transformers 5's ``rope_parameters``."""
    if hf.get("rope_scaling") is not None:
        raise _refuse("rope_scaling", hf["rope_scaling"], "a rescaled rotary embedding")
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _refuse("rope_parameters.rope_type", rope_type, "a rescaled rotary embedding")
    return float(params.get("rope_theta", _get(hf, "rope_theta")))


def _check_window(hf: dict) -> None:
    """Refuse sliding-window attention wherever transformers 5 would apply it (see the module doc)."""
    if hf["model_type"] == "llama":  # LlamaForCausalLM never reads sliding_window
        return
    if hf["model_type"] != "qwen2":
        if _get(hf, "sliding_window") is not None:
            raise _refuse("sliding_window", _get(hf, "sliding_window"), "sliding-window attention")
        return
    if _get(hf, "layer_types") is not None:
        odd = sorted({t for t in hf["layer_types"] if t != "full_attention"})
        if odd:
            raise _refuse("layer_types", odd, "layers without full causal attention")
        return
    window = _get(hf, "sliding_window") if _get(hf, "use_sliding_window") else None
    first = int(_get(hf, "max_window_layers"))
    if window is not None and first < int(hf.get("num_hidden_layers", 0)):
        raise _refuse("use_sliding_window", True, f"sliding-window attention from layer {first} on")


def _check_supported(hf: dict) -> None:
    """Raise ConfigError (one sentence naming the field) for anything tessera does not compute exactly."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _refuse("model_type", model_type, f"an architecture other than {', '.join(MODEL_TYPES)}")
    _check_window(hf)
    if _get(hf, "hidden_act") != "silu":
        raise _refuse("hidden_act", _get(hf, "hidden_act"), "an activation other than SiLU")
    if model_type == "llama":  # the only family whose classes read these two
        for field in ("attention_bias", "mlp_bias"):
            if _get(hf, field):
                raise _refuse(field, hf[field], "biases on projections tessera keeps bias-free")
    if hf.get("quantization_config") is not None:
        raise _refuse("quantization_config", "set", "quantized weights")
    head_dim = _get(hf, "head_dim")
    if head_dim is not None and head_dim != hf["hidden_size"] // hf["num_attention_heads"]:
        raise _refuse("head_dim", head_dim, "a head width other than hidden_size / num_attention_heads")
    if model_type == "mixtral":
        k = int(_get(hf, "num_experts_per_tok"))
        if k == 1 or k > int(_get(hf, "num_local_experts")):
            raise _refuse("num_experts_per_tok", k, "a top-1 router, whose gate transformers renormalises to 1"
                          if k == 1 else "more experts per token than num_local_experts")
        if float(_get(hf, "router_jitter_noise")) > 0:
            raise _refuse("router_jitter_noise", hf["router_jitter_noise"], "noise on the experts' input")


def _moe_of(hf: dict) -> MoEConfig | None:
    """The router a Mixtral config describes (see the module doc); None for a dense family."""
    if hf["model_type"] != "mixtral":
        return None
    return MoEConfig(top_k=int(_get(hf, "num_experts_per_tok")), drop_tokens=False, noisy_gate_policy="none",
                     normalize_top_k=True, aux_loss_coef=float(_get(hf, "router_aux_loss_coef")), z_loss_coef=0.0)


def from_hf_config(hf: dict) -> tuple[ModelConfig, MoEConfig | None]:
    """The tessera (ModelConfig, MoEConfig or None for a dense model) of an HF config dict
    (``config.json``); ConfigError (one sentence naming the field) if refused."""
    _check_supported(hf)
    moe_family = hf["model_type"] == "mixtral"
    try:
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=int(hf["num_attention_heads"]),
            n_kv_heads=int(_get(hf, "num_key_value_heads") or hf["num_attention_heads"]),
            ffn_hidden_dim=int(hf["intermediate_size"]),
            max_seq_len=int(_get(hf, "max_position_embeddings")),
            rope_theta=_rope_theta(hf),
            norm_eps=float(_get(hf, "rms_norm_eps")),
            tie_embeddings=bool(_get(hf, "tie_word_embeddings")),
            qkv_bias=hf["model_type"] == "qwen2",
            init_std=float(_get(hf, "initializer_range")),
            num_experts=int(_get(hf, "num_local_experts")) if moe_family else 0,
            moe_every=1,
        )
    except KeyError as missing:
        raise ConfigError(f"Hugging Face config lacks the field {missing.args[0]!r}.") from None
    moe = _moe_of(hf)
    if moe is not None:
        validate_moe(moe, cfg.num_experts)
    return cfg.validate(), moe


def _check_exportable(cfg: ModelConfig, moe: MoEConfig | None) -> None:
    """Raise ConfigError (one sentence naming the field) for a model no Hugging Face family computes."""
    if not cfg.num_experts:
        return
    moe = moe or MoEConfig()  # what Transformer(cfg, None) builds
    refusals = [
        ("model.moe_every", cfg.moe_every, cfg.moe_every != 1, "Mixtral makes every block MoE"),
        ("model.qkv_bias", cfg.qkv_bias, cfg.qkv_bias, "Mixtral's projections have no biases"),
        ("moe.top_k", moe.top_k, moe.top_k < 2, "Mixtral renormalises a single gate to 1"),
        ("moe.normalize_top_k", moe.normalize_top_k, not moe.normalize_top_k, "Mixtral always renormalises"),
        ("moe.use_residual", moe.use_residual, moe.use_residual, "Mixtral has no residual MLP"),
        ("moe.num_shared_experts", moe.num_shared_experts, moe.num_shared_experts > 0,
         "Mixtral has no shared experts"),
    ]
    for field, value, refused, why in refusals:
        if refused:
            raise ConfigError(f"Model field '{field}' is {value!r}, which no Hugging Face family computes "
                              f"({why}); export needs a dense model or a Mixtral-like one.")


def _common_hf(cfg: ModelConfig, dtype: str) -> dict:
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.ffn_hidden_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers < 5 reads the top-level key, 5 reads rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def to_hf_config(cfg: ModelConfig, moe: MoEConfig | None = None, dtype: str = "float32") -> dict:
    """The ``config.json`` dict of the Hugging Face model (Llama, Qwen2 or Mixtral) equal to tessera's
    ``Transformer(cfg, moe)``; ConfigError naming the field for a model no family computes (module doc)."""
    _check_exportable(cfg, moe)
    out = _common_hf(cfg, dtype)
    if cfg.num_experts:
        moe = moe or MoEConfig()
        out.update(architectures=["MixtralForCausalLM"], model_type="mixtral", head_dim=cfg.head_dim,
                   num_local_experts=cfg.num_experts, num_experts_per_tok=moe.top_k, router_jitter_noise=0.0,
                   router_aux_loss_coef=moe.aux_loss_coef, output_router_logits=False)
    elif cfg.qkv_bias:
        out.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                   max_window_layers=cfg.n_layers, layer_types=["full_attention"] * cfg.n_layers)
    else:
        out.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=cfg.head_dim,
                   attention_bias=False, mlp_bias=False)
    return out
