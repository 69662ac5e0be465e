"""Hugging Face Llama, Mistral, Qwen2 and Mixtral models in and out of tessera, logit for logit.

``load(folder) -> Transformer`` reads ``config.json`` and safetensors (single or sharded), through the
same file-backed initial values that ``tessera train --model.hf`` fills each rank's shards from;
``save(model, folder)`` writes what ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
Neither imports ``transformers``.
"""

from tessera.hf.config import from_hf_config, to_hf_config
from tessera.hf.convert import load, save

__all__ = ["load", "save", "from_hf_config", "to_hf_config"]
