"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``, out and in.

PEFT (``peft.PeftModel.save_pretrained`` / ``from_pretrained``, checked against peft 0.21) stores a LoRA
adapter of a Hugging Face causal LM as the two factors of each adapted linear under the linear's module
path in the model, prefixed by PEFT's wrappers, without the adapter's name::

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   A [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   B [out, r]

and ``adapter_config.json`` holds ``r``, ``lora_alpha`` (scale = alpha / r), ``lora_dropout`` and
``target_modules`` (leaf module names: q_proj … down_proj). tessera's ``LoRALinear`` computes the same
``scale · B A x`` with the same two tensors, so the formats differ only in names (``tessera.hf.names``).

Loading goes through initial-value origins, as ``model.hf`` does: :func:`attach_peft` points each adapter
parameter of a (meta-built, adapted) model at its tensor in the file, so each rank reads only its own
slice of an adapter when the strategies have cut it. An adapter PEFT computes differently (rsLoRA's
alpha / √r, DoRA, trained biases, extra saved modules, per-layer ranks) is refused, never approximated.
Library code: ``peft`` itself is never imported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tessera.errors import ConfigError, UserError
from tessera.hf.names import to_hf, to_tessera
from tessera.hf.safetensors_file import FileTensor, read_header
from tessera.lora.config import LoRAConfig
from tessera.lora.layer import ADAPTER_PARTS, add_lora, adapter_parameters, is_adapter_name
from tessera.models.init import Origin, set_origin

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModelForCausalLM.base_model (LoraModel) .model (the HF model)
# tessera's target name -> the HF module name PEFT's target_modules lists (Llama / Mistral / Qwen2)
HF_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
              "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_TS_TARGETS = {hf: ours for ours, hf in HF_TARGETS.items()}
# adapter_config.json keys whose value must be this (or absent) for PEFT to compute what tessera does
_NEUTRAL = {"use_rslora": False, "use_dora": False, "bias": "none", "lora_bias": False, "fan_in_fan_out": False,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "target_parameters": None, "trainable_token_indices": None,
            "exclude_modules": None, "use_qalora": False, "alora_invocation_tokens": None}
# initialisations that leave the base model as it is (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA rewrite it)
_SAME_BASE_INITS = (True, False, "gaussian", "orthogonal", "eva")


def peft_name(name: str) -> str:
    """PEFT's saved name of tessera adapter tensor ``name`` (``<linear>.lora_A.weight``); ConfigError for an
    adapter that has no Hugging Face module (an expert's: transformers fuses Mixtral's experts)."""
    module, part, _ = name.rsplit(".", 2)
    hf = to_hf(f"{module}.weight")
    if hf is None or ".experts." in hf or part not in ADAPTER_PARTS:
        raise ConfigError(f"The adapter {name!r} has no PEFT counterpart: PEFT adapts the attention and MLP "
                          f"projections of Llama, Mistral and Qwen2 ({', '.join(HF_TARGETS.values())}).")
    return f"{PREFIX}{hf.removesuffix('.weight')}.{part}.weight"


def tessera_name(saved: str) -> str | None:
    """The tessera name of PEFT's saved tensor ``saved``; None if it names no adapter tessera has."""
    if not saved.startswith(PREFIX) or not saved.endswith(".weight"):
        return None
    module, part, _ = saved[len(PREFIX):].rsplit(".", 2)
    ours = to_tessera(f"{module}.weight")
    if ours is None or part not in ADAPTER_PARTS or module.rsplit(".", 1)[-1] not in _TS_TARGETS:
        return None
    return f"{ours.removesuffix('.weight')}.{part}.weight"


def peft_config(cfg: LoRAConfig, base_model: str | None = None) -> dict:
    """``adapter_config.json`` of adapters ``cfg``: what ``peft.LoraConfig`` reads back as the same adapter.
    ``init_lora_weights`` "gaussian" is how tessera starts them (A ~ N(0, 1/r²), B = 0)."""
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else float(cfg.alpha)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": alpha,
            "lora_dropout": float(cfg.dropout), "target_modules": sorted(HF_TARGETS[t] for t in cfg.targets),
            "init_lora_weights": "gaussian", "base_model_name_or_path": base_model, "inference_mode": True,
            **_NEUTRAL}


def write_peft(tensors: dict[str, torch.Tensor], cfg: LoRAConfig, folder: str | os.PathLike,
               base_model: str | None = None) -> Path:
    """Write the adapter tensors ``tensors`` (tessera names -> whole tensors) of adapters ``cfg`` as a PEFT
    folder; returns it. ConfigError for an adapter PEFT cannot hold."""
    out = {peft_name(name): t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    if not out:
        raise ConfigError("There is no adapter to write: the model has no LoRA adapter (lora.rank = 0).")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(peft_config(cfg, base_model), indent=2) + "\n")
    return folder


def save_peft(model: nn.Module, cfg: LoRAConfig, folder: str | os.PathLike, base_model: str | None = None) -> Path:
    """Write the adapters of the whole one-process ``model`` (built with ``add_lora(model, cfg, …)``) as a
    PEFT folder that ``PeftModel.from_pretrained(<the HF model>, folder)`` loads; returns the folder."""
    return write_peft(adapter_parameters(model), cfg, folder, base_model)


def read_peft_config(folder: str | os.PathLike) -> LoRAConfig:
    """The tessera adapters (rank, alpha, dropout, targets) of PEFT folder ``folder``; UserError for a missing
    or unreadable folder, ConfigError (one sentence) for an adapter tessera does not compute exactly."""
    folder = Path(folder).expanduser()
    file = folder / CONFIG_FILE
    if not file.is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise UserError(f"{folder} holds no {CONFIG_FILE} and {WEIGHTS_FILE}; expected a PEFT LoRA adapter "
                        f"folder (adapter_model.bin is not read: save it with safetensors)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{file} is not readable JSON ({err}).") from None
    if raw.get("peft_type") != "LORA":
        raise ConfigError(f"{file} describes a {raw.get('peft_type')} adapter; tessera reads LoRA adapters only.")
    for key, neutral in _NEUTRAL.items():
        value = raw.get(key)
        if value not in (None, neutral) and (value or neutral):  # an empty list or dict is no setting
            raise ConfigError(f"{file} sets {key}={value!r}, which tessera's LoRA does not compute; it "
                              f"reads adapters with {key}={neutral!r}.")
    if raw.get("init_lora_weights") not in (None, *_SAME_BASE_INITS):
        raise ConfigError(f"{file} was initialised with init_lora_weights={raw['init_lora_weights']!r}, "
                          f"which changes the base weights too; convert it to a plain LoRA adapter first.")
    targets = raw.get("target_modules")
    if not isinstance(targets, list) or not set(targets) <= set(_TS_TARGETS):
        raise ConfigError(f"{file} targets {targets!r}; tessera reads adapters on a list of "
                          f"{', '.join(HF_TARGETS.values())}.")
    cfg = LoRAConfig(rank=raw.get("r"), alpha=float(raw.get("lora_alpha") or 8),  # PEFT's default
                     dropout=float(raw.get("lora_dropout") or 0.0),
                     targets=[t for t in HF_TARGETS if HF_TARGETS[t] in targets])
    return cfg.validate()


def check_same_adapters(found: LoRAConfig, cfg: LoRAConfig, folder: str | os.PathLike) -> None:
    """ConfigError unless PEFT folder ``folder``'s adapters (``found``) are the [lora] section ``cfg``'s:
    rank, alpha and targets (dropout is a training knob and may differ)."""
    for key in ("rank", "alpha"):
        if getattr(found, key) != getattr(cfg, key):
            raise ConfigError(f"lora.{key}={getattr(cfg, key)!r} differs from the adapter in {folder}, whose "
                              f"{key} is {getattr(found, key)!r}; set lora.{key} to match it.")
    if set(found.targets) != set(cfg.targets):
        raise ConfigError(f"lora.targets={sorted(cfg.targets)} differs from the adapter in {folder}, which "
                          f"adapts {sorted(found.targets)}; set lora.targets to match it.")


def _adapter_file_tensors(folder: Path) -> dict[str, FileTensor]:
    """The adapter tensors of PEFT folder ``folder`` under tessera names (the header only)."""
    tensors = {}
    for saved, tensor in read_header(folder / WEIGHTS_FILE).items():
        name = tessera_name(saved)
        if name is None:
            raise ConfigError(f"Tensor {saved!r} of {folder / WEIGHTS_FILE} is no LoRA factor of a module "
                              f"tessera adapts.")
        tensors[name] = tensor
    return tensors


def attach_peft(model: nn.Module, folder: str | os.PathLike, cfg: LoRAConfig) -> None:
    """Make the adapters of ``model`` (the whole model, adapted by ``add_lora(model, cfg, …)``, on the meta
    device before any strategy cuts it, or real) take their values from the PEFT adapter in ``folder``:
    on the meta device each rank later reads only its slices; a real model is filled now. ConfigError (one
    sentence) if the folder's adapter is not ``cfg``'s or its tensors do not match the model's adapters."""
    folder = Path(folder).expanduser()
    check_same_adapters(read_peft_config(folder), cfg, folder)
    tensors = _adapter_file_tensors(folder)
    params = adapter_parameters(model)
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ConfigError(f"The adapter in {folder} does not fit the model: missing {missing[:2]}, unexpected "
                          f"{unexpected[:2]}.")
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise ConfigError(f"Adapter tensor {name!r} in {folder} has shape {tuple(tensors[name].shape)}, but "
                              f"the model needs {tuple(p.shape)}.")
        set_origin(p, Origin(tensors[name]))
        if not p.is_meta:
            Origin(tensors[name]).fill_(p.data)


def load_peft(model: nn.Module, folder: str | os.PathLike) -> LoRAConfig:
    """One process: put the PEFT adapter of ``folder`` on ``model`` (a tessera Transformer without adapters,
    e.g. ``tessera.hf.load`` of the adapter's base model): adapters as its config says, with its values.
    Every other parameter is frozen. Returns the adapters' config."""
    if any(is_adapter_name(n) for n, _ in model.named_parameters()):
        raise ValueError("load_peft needs a model without adapters")
    cfg = read_peft_config(folder)
    add_lora(model, cfg, seed=0)  # values overwritten from the folder at once
    attach_peft(model, folder, cfg)
    return cfg


def check_init_from(cfg: LoRAConfig, model_cfg, moe_cfg=None) -> None:
    """Before any rank starts: UserError / ConfigError (one sentence) unless ``cfg.init_from`` (``[lora]
    init_from``) holds a PEFT adapter of ``cfg``'s settings whose tensors fit the model of ``model_cfg``.
    Reads the folder's config and header only; the model is built on the meta device."""
    from tessera.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg, moe_cfg, seed=0)  # nothing allocated or drawn
    add_lora(model, cfg, seed=0)
    attach_peft(model, cfg.init_from, cfg)
