"""``load(path)`` and ``save(model, path)``: a Hugging Face folder <-> a tessera Transformer.

``load`` is the same mechanism as ``tessera train --model.hf``: the model is built on the meta device,
:func:`attach_weights` points every parameter's initial-value origin at its tensor in the folder's
safetensors files (``tessera.hf.safetensors_file``), and ``materialize`` fills it, a chunk at a time. In
training, the strategies cut the meta model first (tp slices, stages, ZeRO-3 shards, experts), so each
rank reads only its own part of the files. ``save`` writes ``config.json`` + ``model.safetensors`` that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. Neither needs ``transformers``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessera.errors import ConfigError, UserError
from tessera.hf.config import from_hf_config, to_hf_config
from tessera.hf.names import is_ignored, to_hf, to_tessera
from tessera.hf.safetensors_file import DTYPES, FileTensor, folder_tensors
from tessera.models.config import ModelConfig
from tessera.models.init import Origin, materialize, origin_of, set_origin
from tessera.models.llama import Transformer
from tessera.models.moe import MoEConfig


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, MoEConfig | None]:
    """(ModelConfig, MoEConfig or None) of the HF model folder ``path``; UserError / ConfigError (one
    sentence) for a missing folder or config.json, or a config tessera does not implement exactly."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a folder; expected a Hugging Face model folder.")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} holds no config.json; expected a Hugging Face model folder.")
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{config_file} is not readable JSON ({err}).") from None
    return from_hf_config(hf)


def _file_tensors(path: Path, tied: bool) -> dict[str, FileTensor]:
    """The folder's tensors under their tessera names (headers only; derived buffers skipped)."""
    tensors: dict[str, FileTensor] = {}
    for hf_name, tensor in folder_tensors(path).items():
        name = to_tessera(hf_name)
        if name is None:
            if is_ignored(hf_name):
                continue
            raise ConfigError(f"Tensor {hf_name!r} of {Path(tensor.path).name} has no place in a tessera model.")
        tensors[name] = tensor
    if tied:  # one tensor: HF omits lm_head (or repeats it); tessera's head is the embedding
        tensors.pop("output.weight", None)
    return tensors


def check_tensors(model: Transformer, shapes: dict[str, tuple[int, ...]], where: object) -> None:
    """ConfigError (one sentence) unless ``shapes`` (tessera name -> shape of each tensor found in ``where``)
    holds every parameter of the whole ``model`` with its shape and nothing else. A tied head is the
    embedding: an ``output.weight`` beside it is ignored."""
    shapes = dict(shapes)
    if model.cfg.tie_embeddings:
        shapes.pop("output.weight", None)
    params = dict(model.named_parameters())  # a tied head is the embedding: listed once
    missing, unexpected = sorted(set(params) - set(shapes)), sorted(set(shapes) - set(params))
    if missing or unexpected:
        raise ConfigError(f"The tensors of {where} do not match the model its config describes: missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]}.")
    for name, p in params.items():
        if tuple(shapes[name]) != tuple(p.shape):
            raise ConfigError(f"Tensor {name!r} of {where} has shape {tuple(shapes[name])}, but its config "
                              f"implies {tuple(p.shape)}.")


def attach_weights(model: Transformer, path: str | os.PathLike) -> None:
    """Make every parameter of ``model`` (the whole model, built on the meta device from the folder's
    config, not yet cut by any strategy) take its initial values from its tensor in the safetensors
    files of HF folder ``path``. Reads headers only; ConfigError (one sentence) if the names or shapes
    there do not match the model."""
    path = Path(path)
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("attach_weights needs a model built on the meta device")
    tensors = _file_tensors(path, model.cfg.tie_embeddings)
    check_tensors(model, {name: t.shape for name, t in tensors.items()}, path)
    for name, p in model.named_parameters():
        set_origin(p, Origin(tensors[name]))


def _stored_dtype(model: Transformer) -> torch.dtype:
    """The dtype the files store the weights in (float32 when they mix several)."""
    stored = {origin_of(p).source.dtype for p in model.parameters()}
    return DTYPES[stored.pop()] if len(stored) == 1 else torch.float32


def load(path: str | os.PathLike, dtype: torch.dtype | None = None) -> Transformer:
    """A tessera Transformer (on the CPU, in the stored dtype unless ``dtype``) equal to the HF model in
    folder ``path``; ConfigError (one sentence) for what tessera does not implement."""
    cfg, moe = read_config(path)
    with torch.device("meta"):
        model = Transformer(cfg, moe, seed=0)  # nothing allocated; the seed is never drawn from
    attach_weights(model, path)
    materialize(model, torch.device("cpu"), dtype or _stored_dtype(model))
    return model


def save(model: Transformer, path: str | os.PathLike, eos_token_id: int | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a whole (one-process) tessera model to folder
    ``path`` so that ``AutoModelForCausalLM.from_pretrained(path)`` gives the same logits;
    ``eos_token_id`` (the tokenizer's end of text) lets its ``generate`` stop where tessera's does."""
    if model.tok_embeddings is None or model.output is None or model.norm is None:
        raise ConfigError("Hugging Face export needs the whole model, not one pipeline stage of it.")
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "output.weight" and model.cfg.tie_embeddings:
            continue  # HF ties lm_head to embed_tokens itself
        hf_name = to_hf(name)
        if hf_name is None:
            raise ConfigError(f"Parameter {name!r} has no Hugging Face counterpart (Llama, Qwen2 or Mixtral).")
        tensors[hf_name] = t.detach().to("cpu").contiguous()
    dtype = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    config = to_hf_config(model.cfg, model.moe_cfg, dtype)
    if eos_token_id is not None:
        config["eos_token_id"] = int(eos_token_id)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
