"""Parameter names: Hugging Face ``LlamaForCausalLM`` <-> tessera ``Transformer`` (same shapes, no transposes).

Both store a linear's weight as [out, in] and use the rotate-half RoPE layout, so each tensor maps by
name alone; no row permutation of q/k is needed (that is only for Meta's original interleaved layout).
"""

from __future__ import annotations

import re

_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
_TS_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight")
# Derived buffers some older checkpoints saved; tessera recomputes them from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def is_ignored(hf_name: str) -> bool:
    return bool(_IGNORED.fullmatch(hf_name))


def to_tessera(hf_name: str) -> str | None:
    """The tessera name of HF tensor ``hf_name``; None if it has none."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    m = _HF_LAYER.fullmatch(hf_name)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    return None


def to_hf(name: str) -> str | None:
    """The HF name of tessera parameter ``name``; None if it has none (e.g. an MoE router)."""
    for hf_name, ours in _TOP.items():
        if ours == name:
            return hf_name
    m = _TS_LAYER.fullmatch(name)
    if m:
        for hf_part, ours in _LAYER.items():
            if ours == m.group(2):
                return f"model.layers.{m.group(1)}.{hf_part}.weight"
    return None
