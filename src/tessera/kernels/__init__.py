"""Implementation choices for hot operations (``[kernels]``): fused/foreach AdamW, ``F.rms_norm``, SDPA's
grouped-query attention, ``torch.compile`` of blocks. Same mathematics as the defaults; see config.py."""

from tessera.kernels.config import KernelsConfig

__all__ = ["KernelsConfig"]
