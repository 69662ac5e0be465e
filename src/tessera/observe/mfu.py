"""Achieved model FLOP/s and model FLOPs utilisation (MFU) for every train metrics line.

Model FLOPs are the planner's count (``tessera.planner.flops.model_flops``): 6 per matmul weight per token
plus attention's score and value matmuls, 4 per frozen weight with LoRA, and no recomputation, as PaLM's
MFU counts them — re-running forwards for activation checkpointing is work the hardware does, not
progress of the model. ``flops_per_s`` is one rank's share: the job's model FLOP/s ÷ world size.

``mfu`` divides it by one device's peak: ``run.peak_flops`` when given; else the planner's GPU
catalogue entry for a known accelerator name (its dense bf16 peak, whatever precision the run uses);
else null — a CPU has no data-sheet peak (give the ``peak_flops`` that ``tessera plan --calibrate``
measures: one thread's matmul rate, the share one rank runs on).
"""

from __future__ import annotations

import re

import torch

from tessera.planner.catalog import GPUS, from_model_config
from tessera.planner.flops import model_flops

# accelerator names as the driver reports them ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB")
# -> planner catalogue keys; the first pattern that matches wins
_CATALOGUE_NAMES = (
    (r"h200", "h200"),
    (r"h100", "h100"),
    (r"a100.*40\s*gb", "a100-40gb"),
    (r"a100", "a100-80gb"),
)


def catalogue_peak(device_name: str) -> float | None:
    """The planner catalogue's peak FLOP/s for an accelerator name, or None when it is not listed."""
    for pattern, key in _CATALOGUE_NAMES:
        if re.search(pattern, device_name.lower()):
            return GPUS[key].peak_flops
    return None


def device_peak(device: torch.device) -> float | None:
    """One device's peak FLOP/s from the catalogue: None on a CPU or an accelerator it does not list."""
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type)  # torch.cuda, torch.xpu ...: whichever the device is
    return catalogue_peak(backend.get_device_properties(device.index or 0).name)


class ModelFlops:
    """Model FLOPs per token of a job and the peak to divide by; ``fields(tokens_per_s)`` gives the two
    metrics-line fields."""

    def __init__(self, cfg, device: torch.device, world_size: int):
        spec = from_model_config("run", cfg.model, top_k=cfg.moe.top_k, lora=cfg.lora)
        self.per_token = model_flops(spec, 1.0, cfg.data.seq_len)  # FLOPs, forward + backward
        self.world_size = world_size
        self.peak = cfg.run.peak_flops or device_peak(device)

    def fields(self, tokens_per_s: float) -> dict:
        """``tokens_per_s`` counts the whole job's tokens (the global batch), so each rank's share of
        the model FLOP/s is the job's ÷ world size."""
        per_rank = self.per_token * tokens_per_s / self.world_size
        return {"flops_per_s": per_rank, "mfu": per_rank / self.peak if self.peak else None}
