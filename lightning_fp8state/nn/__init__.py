"""Quantized modules and model conversion."""

from .attention import Fp4AttentionQuantizer
from .conv1d import Fp8Conv1D, is_hf_conv1d
from .convert import ConversionReport, convert_model
from .experts import Fp8Experts, GroupedExperts, keep_in_high_precision
from .gemm import scaled_matmul, scaled_mm_available
from .linear import LINEAR_ROLES, Fp8Linear
from .prologue import ACTIVATIONS, Prologue, linear_after, register_rms_norm
from .transformer import Fp8MultiheadAttention, Fp8TransformerEncoderLayer

__all__ = [
    "ACTIVATIONS",
    "LINEAR_ROLES",
    "ConversionReport",
    "Fp4AttentionQuantizer",
    "Fp8Conv1D",
    "Fp8Experts",
    "Fp8Linear",
    "Fp8MultiheadAttention",
    "Fp8TransformerEncoderLayer",
    "GroupedExperts",
    "Prologue",
    "convert_model",
    "is_hf_conv1d",
    "keep_in_high_precision",
    "linear_after",
    "register_rms_norm",
    "scaled_matmul",
    "scaled_mm_available",
]
