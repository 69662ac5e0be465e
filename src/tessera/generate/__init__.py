"""Text generation from a whole one-device model: KV-cache decoding (greedy or top-p), the
``tessera generate`` command, and ``tessera export --format hf`` of a checkpoint of any layout.

Batch 1, one process: these are tools for using a trained model, not part of training.
"""

from tessera.generate.decode import generate
from tessera.generate.kv_cache import KVCache
from tessera.generate.sampling import Sampling, nucleus_probs

__all__ = ["generate", "KVCache", "Sampling", "nucleus_probs"]
