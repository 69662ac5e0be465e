"""Hugging Face Llama/Mistral models in and out of tessera, logit for logit.

``load(folder) -> Transformer`` reads ``config.json`` and safetensors (single or sharded);
``save(model, folder)`` writes what ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
Neither imports ``transformers``.
"""

from tessera.hf.config import from_hf_config, to_hf_config
from tessera.hf.convert import load, save

__all__ = ["load", "save", "from_hf_config", "to_hf_config"]
