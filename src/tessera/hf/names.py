"""Parameter names: Hugging Face Llama / Mistral / Qwen2 / Mixtral <-> tessera ``Transformer`` (same shapes).

Both store a linear's weight as [out, in] and use the rotate-half RoPE layout, so each tensor maps by
name alone; no row permutation of q/k is needed (that is only for Meta's original interleaved layout).
Qwen2's q/k/v biases map to ``attention.w{q,k,v}.bias``. Mixtral's experts use the names its checkpoints
are saved under (transformers 5 still writes them, and fuses them into 3D tensors only in memory):
``block_sparse_moe.gate`` is tessera's ``feed_forward.router.gate`` and ``block_sparse_moe.experts.E.w{1,2,3}``
its ``feed_forward.experts.E.w{1,2,3}`` (w1 gate, w3 up, w2 down in both).
"""

from __future__ import annotations

import re

_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # HF module path inside a block → tessera's
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "block_sparse_moe.gate": "feed_forward.router.gate",
}
_BIASED = ("attention.wq", "attention.wk", "attention.wv")  # Qwen2: the only linears with a bias
_HF_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])")
_TS_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(w[123])")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_TS_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_TO_HF = {ours: hf for hf, ours in _LAYER.items()}
# Derived buffers some older checkpoints saved; tessera recomputes them from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def is_ignored(hf_name: str) -> bool:
    return bool(_IGNORED.fullmatch(hf_name))


def _module_to_tessera(hf_module: str) -> str | None:
    m = _HF_EXPERT.fullmatch(hf_module)
    return f"feed_forward.experts.{m.group(1)}.{m.group(2)}" if m else _LAYER.get(hf_module)


def _module_to_hf(module: str) -> str | None:
    m = _TS_EXPERT.fullmatch(module)
    return f"block_sparse_moe.experts.{m.group(1)}.{m.group(2)}" if m else _TO_HF.get(module)


def to_tessera(hf_name: str) -> str | None:
    """The tessera name of HF tensor ``hf_name``; None if it has none."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    m = _HF_LAYER.fullmatch(hf_name)
    if not m:
        return None
    module = _module_to_tessera(m.group(2))
    if module is None or (m.group(3) == "bias" and module not in _BIASED):
        return None
    return f"layers.{m.group(1)}.{module}.{m.group(3)}"


def to_hf(name: str) -> str | None:
    """The HF name of tessera parameter ``name``; None if it has none (e.g. a residual MoE's mixer)."""
    for hf_name, ours in _TOP.items():
        if ours == name:
            return hf_name
    m = _TS_LAYER.fullmatch(name)
    if not m or (m.group(3) == "bias" and m.group(2) not in _BIASED):
        return None
    hf_module = _module_to_hf(m.group(2))
    return None if hf_module is None else f"model.layers.{m.group(1)}.{hf_module}.{m.group(3)}"
