"""The job's model before any strategy touches it: described on the meta device, nothing allocated."""

from __future__ import annotations

import torch

from tessera.lora import add_lora
from tessera.models import Transformer
from tessera.train.config import JobConfig


def meta_model(cfg: JobConfig) -> Transformer:
    """The job's model described on the meta device, nothing allocated: every strategy claims its part
    (stages, tp slices, experts), then each rank allocates and fills only what it holds
    (``tessera.parallelize`` / the pipeline; ZeRO-3 its flat shards), with the values one process has:
    a function of (``run.seed``, parameter name) only (``tessera.models.init``). With ``model.hf`` those
    values are the folder's safetensors tensors instead, read where each rank's part lies (``tessera.hf``).
    With ``lora.rank`` > 0 the target linears get adapters (initial values from (seed, name) too) and every
    other parameter is frozen (``tessera.lora.add_lora``), so every strategy sees the adapted model."""
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe, seed=cfg.run.seed)
    if cfg.model_hf:
        from tessera.hf.convert import attach_weights

        attach_weights(model, cfg.model_hf)
    add_lora(model, cfg.lora, cfg.run.seed)
    return model


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, trainable ones): with LoRA the trainable ones are the adapters."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
