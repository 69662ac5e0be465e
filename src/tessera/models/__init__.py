"""Single-device reference model (Llama-style decoder). Never imports torch.distributed."""

from tessera.models.config import PRESETS, ModelConfig, model_config
from tessera.models.llama import Transformer
from tessera.models.loss import cross_entropy_sum
from tessera.models.moe import MoEConfig, moe_loss_sum

__all__ = ["ModelConfig", "PRESETS", "model_config", "Transformer", "cross_entropy_sum", "MoEConfig",
           "moe_loss_sum"]
