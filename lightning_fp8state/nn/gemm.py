"""The per-tensor FP8 GEMM, re-exported from :mod:`lightning_fp8state.quant_recipes.gemm` (where the
recipes that use it live); kept so that ``lightning_fp8state.nn.gemm`` keeps working."""

from __future__ import annotations

from ..quant_recipes.gemm import _capability, _emulated, _mm_device, _row_major, scaled_matmul, scaled_mm_available

__all__ = ["_capability", "_emulated", "_mm_device", "_row_major", "scaled_matmul", "scaled_mm_available"]
