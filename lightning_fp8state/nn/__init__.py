"""Quantized modules and model conversion."""

from .attention import Fp4AttentionQuantizer
from .convert import ConversionReport, convert_model
from .gemm import scaled_matmul, scaled_mm_available
from .linear import LINEAR_ROLES, Fp8Linear

__all__ = [
    "LINEAR_ROLES",
    "ConversionReport",
    "Fp4AttentionQuantizer",
    "Fp8Linear",
    "convert_model",
    "scaled_matmul",
    "scaled_mm_available",
]
