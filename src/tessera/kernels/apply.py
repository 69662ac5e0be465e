"""``[kernels]`` adamw, rms_norm and gqa: where each choice is put, and the layouts where one cannot act.

- ``rms_norm`` and ``gqa`` are attributes of the modules that compute them (``rms_norm_kernel`` on
  ``RMSNorm`` and the sequence-parallel norm, ``gqa_kernel`` on ``CausalCoreAttention`` and the 2D/2.5D/3D
  attention), set by :func:`apply_kernels` on the built model, after tensor and context parallelism have
  replaced their modules and before ``torch.compile`` traces them. They are not ``[model]`` keys: those
  describe the architecture (and export to Hugging Face); these only choose how it is computed.
- ``adamw`` reaches the optimizer class of ``optim.name`` through ``tessera.train.optim.optimizer_factory``,
  the one place every optimizer is built (plain, DDP, the ZeRO engines, pipeline stages, expert engines; disk
  offload's streamed AdamW keeps the template's choice per chunk). torch's AdamW, Adam, SGD and Adagrad all
  have a foreach and a fused implementation on CPU and CUDA, so every choice acts with every optimizer.
"""

from __future__ import annotations

from torch import nn

from tessera.errors import ConfigError
from tessera.kernels.config import KernelsConfig


def apply_kernels(model: nn.Module, cfg: KernelsConfig | None) -> nn.Module:
    """In place: every norm of ``model`` computes with ``cfg.rms_norm``, every attention core with
    ``cfg.gqa``. ``None`` (a model built outside a job) leaves the defaults. Returns ``model``."""
    if cfg is None:
        return model
    for module in model.modules():
        if hasattr(module, "rms_norm_kernel"):
            module.rms_norm_kernel = cfg.rms_norm
        if hasattr(module, "gqa_kernel"):
            module.gqa_kernel = cfg.gqa
    return model


def check_kernels(cfg, parallel) -> None:
    """Refuse, with one sentence, a ``[kernels]`` choice the layout has no operation for (``cfg`` a
    JobConfig, ``parallel`` its resolved ParallelConfig). Only by construction:

    - rms_norm="torch" under 2D/2.5D/3D tensor parallelism: each rank holds D/q features of a token, and the
      norm's mean square is summed over the q ranks (an all-reduce) between the square and the rsqrt;
      ``F.rms_norm`` takes the mean over the features it is given, so it has no place to put that sum.
    - gqa="sdpa" with ring or ring self-attention context parallelism: those cores compute attention block
      by block with their own softmax over kv chunks passed round the ring, never one SDPA call, so there is
      no ``enable_gqa`` to hand the kv heads to (Ulysses runs SDPA on whole sequences and takes it).
    - compile with checkpointing.mode="selective": the selective policy chooses what to keep by the aten
      ops it sees dispatched, and a compiled block's generated code does not dispatch its matmuls as those
      ops (inductor fuses them or calls out-variants), so the policy would keep almost nothing (tiny model,
      inductor: 76 KB kept against 142 KB eager, about what full checkpointing keeps)."""
    k = cfg.kernels
    if k.rms_norm == "torch" and parallel.tp > 1 and cfg.tensor_parallel.mode != "1d":
        raise ConfigError(f"kernels.rms_norm='torch' cannot act with tensor_parallel.mode="
                          f"{cfg.tensor_parallel.mode!r}: its norm sums each token's squares over the ranks "
                          "holding the other feature blocks, which F.rms_norm cannot do; use "
                          "kernels.rms_norm='reference' or tensor_parallel.mode='1d'")
    if k.gqa == "sdpa" and parallel.cp > 1 and cfg.context_parallel.method != "ulysses":
        raise ConfigError(f"kernels.gqa='sdpa' cannot act with context_parallel.method="
                          f"{cfg.context_parallel.method!r}: that core computes attention block by block round "
                          "the ring, not with SDPA; use kernels.gqa='repeat' or context_parallel.method='ulysses'")
    if k.compile and cfg.checkpointing.mode == "selective":
        raise ConfigError("kernels.compile=true cannot be combined with checkpointing.mode='selective': the "
                          "selective policy keeps the matmul outputs it sees dispatched, and a compiled block's "
                          "generated code hides them from it; use checkpointing.mode='full' or kernels.compile=false")
