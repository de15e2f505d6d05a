"""The fp8state custom ops: call these, never the reference functions, on the hot path.

On CPU (and on CUDA until the ``csrc/`` kernels are built) they run the pure-torch
reference; with the CUDA extension loaded the same calls run the fused kernels.
"""

from __future__ import annotations

import torch

from . import cuda
from . import library as _library  # noqa: F401  (defines the schemas and kernels)
from .reference import (
    amax_reference,
    dequantize_fp8_reference,
    quantize_fp8_reference,
    update_scales_reference,
)

__all__ = [
    "amax_reference",
    "cuda",
    "dequantize_fp8",
    "dequantize_fp8_reference",
    "quantize_fp8",
    "quantize_fp8_record_amax",
    "quantize_fp8_reference",
    "update_scales",
    "update_scales_reference",
]

_ops = torch.ops.fp8state


def _on_cuda(t: torch.Tensor) -> None:
    # one dict lookup after the first call: builds/loads the kernels on first CUDA use
    if t.is_cuda and not cuda._state["tried"]:
        cuda.ensure_loaded()


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Encode ``x`` as FP8 with ``scale``; records nothing (the recompute path)."""
    _on_cuda(x)
    return _ops.quantize_fp8(x, scale, dtype)


def quantize_fp8_record_amax(
    x: torch.Tensor, scale: torch.Tensor, amax_pending: torch.Tensor, slot: int, dtype: torch.dtype
) -> torch.Tensor:
    """Encode ``x`` as FP8 and fold ``max|x|`` into ``amax_pending[slot]`` (NaN sticks)."""
    _on_cuda(x)
    return _ops.quantize_fp8_record_amax(x, scale, amax_pending, slot, dtype)


def dequantize_fp8(q: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decode FP8 ``q`` with ``descale`` into ``dtype``."""
    _on_cuda(q)
    return _ops.dequantize_fp8(q, descale, dtype)


def update_scales(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    descale: torch.Tensor,
    amax_pending: torch.Tensor,
    nonfinite_count: torch.Tensor,
    commit_mask: torch.Tensor,
    fmax: torch.Tensor,
    amax_algo: str,
    margin: int,
) -> None:
    """Advance all owners selected by ``commit_mask`` in one batched update (in place)."""
    _on_cuda(amax_history)
    _ops.update_scales(
        amax_history, scale, descale, amax_pending, nonfinite_count, commit_mask, fmax, amax_algo, margin
    )
