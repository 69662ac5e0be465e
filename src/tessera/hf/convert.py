"""``load(path)`` and ``save(model, path)``: a Hugging Face Llama/Mistral folder <-> a tessera Transformer.

``load`` builds the model on the meta device and hands the read tensors to it (``assign=True``), so
every weight is allocated once, by safetensors. ``save`` writes ``config.json`` + ``model.safetensors``
that ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Neither needs ``transformers``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tessera.errors import ConfigError, UserError
from tessera.hf.config import from_hf_config, to_hf_config
from tessera.hf.names import is_ignored, to_hf, to_tessera
from tessera.models.llama import Transformer


def _shard_files(path: Path) -> list[Path]:
    """The safetensors files of an HF folder: one ``model.safetensors`` or those a sharded index lists."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    raise UserError(f"{path} holds neither model.safetensors nor model.safetensors.index.json.")


def _read_state_dict(path: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder under its tessera name (optionally cast to ``dtype``)."""
    sd: dict[str, torch.Tensor] = {}
    for file in _shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                name = to_tessera(hf_name)
                if name is None:
                    if is_ignored(hf_name):
                        continue
                    raise ConfigError(f"Tensor {hf_name!r} of {file.name} has no place in a llama/mistral model.")
                t = f.get_tensor(hf_name)
                sd[name] = t if dtype is None else t.to(dtype)
    return sd


def load(path: str | os.PathLike, dtype: torch.dtype | None = None) -> Transformer:
    """A tessera Transformer (on the CPU, in the stored dtype unless ``dtype``) equal to the HF Llama or
    Mistral model in folder ``path``; ConfigError (one sentence) for what tessera does not implement."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} holds no config.json; expected a Hugging Face model folder.")
    cfg = from_hf_config(json.loads(config_file.read_text()))
    sd = _read_state_dict(path, dtype)
    if cfg.tie_embeddings:  # one tensor: HF omits lm_head (or repeats it); tessera's head is the embedding
        sd.pop("output.weight", None)
        if "tok_embeddings.weight" in sd:
            sd["output.weight"] = sd["tok_embeddings.weight"]
    with torch.device("meta"):
        model = Transformer(cfg, seed=0)  # nothing allocated; the seed is never drawn from
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ConfigError(f"{path} does not match its config.json: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    for name, p in model.state_dict().items():
        if tuple(sd[name].shape) != tuple(p.shape):
            raise ConfigError(f"Tensor {name!r} of {path} has shape {tuple(sd[name].shape)}, "
                              f"but config.json implies {tuple(p.shape)}.")
    model.load_state_dict(sd, assign=True)
    model._tie()  # assign gave output and embedding separate Parameters; make them one again
    model.init_buffers(torch.device("cpu"))
    return model


def save(model: Transformer, path: str | os.PathLike) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a whole (one-process, dense) tessera model to
    folder ``path`` so that ``AutoModelForCausalLM.from_pretrained(path)`` gives the same logits."""
    if model.tok_embeddings is None or model.output is None or model.norm is None:
        raise ConfigError("Hugging Face export needs the whole model, not one pipeline stage of it.")
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "output.weight" and model.cfg.tie_embeddings:
            continue  # HF ties lm_head to embed_tokens itself
        hf_name = to_hf(name)
        if hf_name is None:
            raise ConfigError(f"Parameter {name!r} has no Hugging Face Llama counterpart; export needs a dense model.")
        tensors[hf_name] = t.detach().to("cpu").contiguous()
    dtype = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    config = to_hf_config(model.cfg, dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
