"""``[model] hf = "DIR"``: a training job that starts from a Hugging Face model's weights.

The folder's ``config.json`` gives the model (``ModelConfig``, and for Mixtral the ``[moe]`` section);
the trainer builds that model on the meta device as for any job and :func:`tessera.hf.convert.attach_weights`
points each parameter's initial values at its tensor in the safetensors files, so every rank fills only its
own shards from the files. Settings that would contradict the weights are refused; the rest stay settable:

- ``model.dropout`` and ``model.max_seq_len`` (no weight depends on them: the RoPE tables are computed for
  any length) may be set; any other ``model.*`` key may only repeat the folder's value (so the run's saved
  ``config.toml`` is accepted back on a resume).
- ``moe.top_k``, ``moe.normalize_top_k``, ``moe.use_residual`` and ``moe.num_shared_experts`` define the
  Mixtral model and likewise may only repeat its value; the router's training knobs (capacities, token
  dropping, noise, loss coefficients) may be set.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tessera.errors import ConfigError
from tessera.hf.convert import attach_weights, read_config
from tessera.models.config import ModelConfig
from tessera.models.llama import Transformer
from tessera.models.moe import MoEConfig

SETTABLE = ("dropout", "max_seq_len")  # model keys an imported model may change
MOE_FIXED = ("top_k", "normalize_top_k", "use_residual", "num_shared_experts")  # part of the HF model


def _contradiction(key: str, value, theirs) -> ConfigError:
    return ConfigError(f"{key}={value!r} contradicts the model of model.hf, whose config.json gives {theirs!r}; "
                       f"with model.hf only model.{' and model.'.join(SETTABLE)} and the [moe] training "
                       f"knobs may be set")


def job_model(folder: str, model_keys: dict, moe_keys: dict) -> tuple[ModelConfig, MoEConfig]:
    """(model, moe) sections of a job started from HF ``folder``: its config, with the user's typed
    ``model_keys`` / ``moe_keys`` (the [model] keys besides preset and hf, the [moe] keys) applied where
    they may be (module doc); ConfigError (one sentence) for a missing folder, an unsupported config or a
    key that contradicts it."""
    every_key = {f.name for f in dataclasses.fields(ModelConfig)}
    if set(model_keys) >= every_key and not Path(folder).expanduser().is_dir():
        # a run's saved config.toml lists every model key: its checkpoints describe their model without the
        # folder (generate, export); training from the folder's weights still needs it (check_weights)
        return ModelConfig(**model_keys).validate(), MoEConfig(**moe_keys)
    cfg, moe = read_config(folder)
    for key, value in model_keys.items():
        if key not in SETTABLE and value != getattr(cfg, key):
            raise _contradiction(f"model.{key}", value, getattr(cfg, key))
    cfg = dataclasses.replace(cfg, **{k: v for k, v in model_keys.items() if k in SETTABLE}).validate()
    if moe is None:  # a dense model: [moe] keys are refused later as settings without effect
        return cfg, MoEConfig(**moe_keys)
    for key in MOE_FIXED:
        if key in moe_keys and moe_keys[key] != getattr(moe, key):
            raise _contradiction(f"moe.{key}", moe_keys[key], getattr(moe, key))
    return cfg, dataclasses.replace(moe, **moe_keys)


def check_weights(folder: str, model: ModelConfig, moe: MoEConfig) -> None:
    """Refuse (ConfigError, one sentence) safetensors files in ``folder`` whose tensor names or shapes do
    not match ``model``: reads the headers only, and builds the model on the meta device."""
    with torch.device("meta"):
        meta = Transformer(model, moe, seed=0)
    attach_weights(meta, Path(folder))
