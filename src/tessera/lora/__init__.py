"""LoRA: low-rank adapters on chosen linear layers, frozen base weights, on every layout."""

from tessera.lora.config import TARGETS, LoRAConfig
from tessera.lora.layer import (LoRALinear, adapter_parameters, add_lora, has_adapter, is_adapter_name,
                                lora_delta, make_adapter)

__all__ = ["TARGETS", "LoRAConfig", "LoRALinear", "add_lora", "adapter_parameters", "has_adapter",
           "is_adapter_name", "lora_delta", "make_adapter"]
