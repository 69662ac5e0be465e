"""Mixed precision: low-precision parameters and gradients, fp32 master weights in the (sharded)
optimizer, gradient reduction in a configurable dtype, dynamic loss scaling."""

from tessera.precision.config import DTYPES, PrecisionConfig
from tessera.precision.frozen import hold_frozen
from tessera.precision.scaler import LossScaler
from tessera.precision.unscale import agree_finite, nonfinite, unscale_

__all__ = ["DTYPES", "LossScaler", "PrecisionConfig", "agree_finite", "hold_frozen", "nonfinite", "unscale_"]
