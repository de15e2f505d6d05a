"""Pure-torch references of the stateless (dynamic) scalings: a scale from the call's own amax,
per tensor (``fp8_current``) or per row (``fp8_rowwise``). The oracle of their kernels.

The scale follows the delayed update's formula and guards (:func:`.reference.update_scales_reference`):
``scale = fmax / amax / 2**margin`` (IEEE float32 divisions, in that order), ``descale = 1 /
scale``, unless the amax is zero or the scale would not be finite (a NaN or infinite amax, a
subnormal one); having no earlier scale to keep, such a call gets ``scale = descale = 1``.
Encoding is the FP8 encoding of ``formats`` with that scale (a NaN stays the canonical NaN).
"""

from __future__ import annotations

import torch

from ..formats import fp8_format
from .reference import CANONICAL_NAN_FP8, amax_reference, canonical_nan

__all__ = [
    "current_scale_reference",
    "dynamic_scale_reference",
    "quantize_fp8_colwise_reference",
    "quantize_fp8_current_reference",
    "quantize_fp8_rowwise_reference",
    "quantize_fp8_scaled_reference",
    "row_amax_reference",
]


def dynamic_scale_reference(amax: torch.Tensor, fmax: float, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, descale)`` of ``amax`` (float32, any shape): ``fmax / amax / 2**margin`` and its
    reciprocal, or 1 and 1 where that amax is zero or not finite (the delayed update never rolls
    a non-finite amax into a history) or the scale would not be finite."""
    candidate = torch.full_like(amax, fmax) / amax / float(2**margin)
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(candidate)
    one = torch.ones_like(candidate)
    return torch.where(ok, candidate, one), torch.where(ok, torch.reciprocal(candidate), one)


def row_amax_reference(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of every row of the 2-D ``x`` as float32 ``[R, 1]``; the canonical NaN for a
    row holding NaN; 0 for empty rows."""
    if x.shape[-1] == 0:
        return torch.zeros((x.shape[0], 1), dtype=torch.float32, device=x.device)
    return canonical_nan(x.detach().abs().amax(dim=-1, keepdim=True).to(torch.float32))


def quantize_fp8_scaled_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes of ``float32(x) * scale`` (``scale`` broadcast: a scalar, or ``[R, 1]``), clamped
    to ±max and rounded to nearest even; NaN becomes the canonical code 0x7F."""
    fmt = fp8_format(dtype)
    v = x.to(torch.float32) * scale.to(torch.float32)
    q = v.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    nan = torch.full((), CANONICAL_NAN_FP8, dtype=torch.uint8, device=q.device)
    return torch.where(torch.isnan(v), nan, q.view(torch.uint8)).view(fmt.dtype)


def current_scale_reference(x: torch.Tensor, dtype: torch.dtype, margin: int):
    """``(scale, descale, amax)`` of per-tensor current scaling: float32 scalars (0-d) from
    ``x``'s own amax."""
    amax = amax_reference(x)
    scale, descale = dynamic_scale_reference(amax, fp8_format(dtype).max, margin)
    return scale, descale, amax


def quantize_fp8_current_reference(x: torch.Tensor, dtype: torch.dtype, margin: int):
    """Per-tensor current scaling: ``(codes, scale, descale, amax)``, the three float32 scalars
    (0-d) from ``x``'s own amax."""
    scale, descale, amax = current_scale_reference(x, dtype, margin)
    return quantize_fp8_scaled_reference(x, scale, dtype), scale, descale, amax


def quantize_fp8_rowwise_reference(x: torch.Tensor, dtype: torch.dtype, margin: int):
    """Rowwise scaling of the 2-D ``x [R, C]``: ``(codes [R, C], scale, descale, amax)``, the
    last three float32 ``[R, 1]``, one per row, from that row's own amax."""
    amax = row_amax_reference(x)
    scale, descale = dynamic_scale_reference(amax, fp8_format(dtype).max, margin)
    return quantize_fp8_scaled_reference(x, scale, dtype), scale, descale, amax


def quantize_fp8_colwise_reference(x: torch.Tensor, dtype: torch.dtype, margin: int):
    """Each column of the 2-D ``x [R, C]`` scaled by its own amax, the codes written transposed:
    ``quantize_fp8_rowwise_reference(x^T)``, i.e. ``(codes [C, R] contiguous, scale, descale,
    amax)``, the last three float32 ``[C, 1]``. The operands of fp8_rowwise's weight gradient and
    input gradient (scaled along the dimension the GEMM keeps, K-major as cuBLASLt wants them)."""
    q, scale, descale, amax = quantize_fp8_rowwise_reference(x.t(), dtype, margin)
    return q.contiguous(), scale, descale, amax
