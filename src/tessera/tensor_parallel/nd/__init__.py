"""Colossal-AI's 2D (SUMMA), 2.5D (Tesseract) and 3D tensor-parallel layers, block and whole model (``model.py``)."""

from tessera.tensor_parallel.nd.block import (
    AttentionND,
    Layout2D,
    Layout3D,
    MLPND,
    NormND,
    TransformerBlockND,
)
from tessera.tensor_parallel.nd.cube import Linear3D
from tessera.tensor_parallel.nd.embedding import EmbeddingND
from tessera.tensor_parallel.nd.grid import Grid2D, Grid3D
from tessera.tensor_parallel.nd.summa import Linear2D

__all__ = ["EmbeddingND", "Grid2D", "Grid3D", "Layout2D", "Layout3D", "Linear2D", "Linear3D", "NormND", "MLPND",
           "AttentionND", "TransformerBlockND"]
