"""The fused RMSNorm + FP8 quantize ops of the ``fp8state`` library and the RMSNorm's backward:
schemas, checks, reference and fake kernels (numerics: :mod:`.reference_rms`; CUDA:
``csrc/fused_ops.cu`` for the forward, ``csrc/ln_ops.cu`` for the backward).

Same conventions as :mod:`.library_fused`: rows of whole 16-byte chunks up to
:func:`~.library_fused.layer_norm_max_width`, an optional float32 weight. The forward returns
``(codes, rstd)``; ``rms_norm_backward`` takes that ``rstd`` and returns ``(dx, dweight)`` (None
where ``output_mask`` says so).
"""

from __future__ import annotations

import torch

from ..config import require_that
from . import reference_rms as ref
from .library import (
    _IN_DTYPES,
    LIB,
    SATURATION_ARG,
    _check_pending,
    _check_saturation,
    check_quantize_args,
    encode_record,
)
from .library_fused import _check_affine, _check_row_width, _codes_like

__all__ = ["check_rms_norm_args", "check_rms_norm_backward_args"]

LIB.define(
    "rms_norm_quantize_fp8(Tensor x, Tensor? weight, float eps, Tensor scale, ScalarType dtype) -> (Tensor, Tensor)"
)
LIB.define(
    "rms_norm_quantize_fp8_record_amax(Tensor x, Tensor? weight, float eps, Tensor scale, Tensor(a!) amax_pending, "
    f"int slot, ScalarType dtype, {SATURATION_ARG}) -> (Tensor, Tensor)"
)
LIB.define(
    "rms_norm_backward(Tensor grad_y, Tensor x, Tensor rstd, Tensor? weight, bool[2] output_mask) -> (Tensor?, Tensor?)"
)


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale, dtype) -> None:
    """Validate the fused RMSNorm's arguments (the quantize ones, the row width, eps, the weight)."""
    check_quantize_args(x, scale, dtype)
    _check_row_width(x)
    require_that(eps >= 0, "eps", eps, ">= 0")
    _check_affine("weight", weight, x)


def check_rms_norm_backward_args(grad_y, x, rstd, weight, output_mask) -> None:
    """Validate ``rms_norm_backward``'s arguments (``x``'s width as the forward's, ``grad_y`` like
    ``x``, one float32 ``rstd`` per row, the optional float32 weight)."""
    require_that(x.dtype in _IN_DTYPES, "x.dtype", x.dtype, f"one of {list(_IN_DTYPES)}")
    d = _check_row_width(x)
    require_that(grad_y.dtype == x.dtype, "grad_y.dtype", grad_y.dtype, str(x.dtype))
    require_that(grad_y.shape == x.shape, "grad_y.shape", tuple(grad_y.shape), tuple(x.shape))
    require_that(grad_y.device == x.device, "grad_y.device", grad_y.device, str(x.device))
    rows = x.numel() // d
    require_that(rstd.dtype == torch.float32, "rstd.dtype", rstd.dtype, "torch.float32")
    require_that(rstd.numel() == rows, "rstd.numel()", rstd.numel(), f"{rows} (one per row of x)")
    require_that(rstd.device == x.device, "rstd.device", rstd.device, str(x.device))
    _check_affine("weight", weight, x)
    require_that(len(output_mask) == 2, "len(output_mask)", len(output_mask), "2")


@torch.library.impl(LIB, "rms_norm_quantize_fp8", "CompositeExplicitAutograd")
def _rms_norm_quantize_fp8(x, weight, eps, scale, dtype):
    check_rms_norm_args(x, weight, eps, scale, dtype)
    return ref.rms_norm_quantize_fp8_reference(x, weight, eps, scale, dtype)[:2]


@torch.library.impl(LIB, "rms_norm_quantize_fp8_record_amax", "CompositeExplicitAutograd")
def _rms_norm_quantize_fp8_record_amax(x, weight, eps, scale, amax_pending, slot, dtype, saturation=None):
    check_rms_norm_args(x, weight, eps, scale, dtype)
    _check_pending(amax_pending, slot, x.device)
    _check_saturation(saturation, amax_pending, x.device)
    y, rstd = ref.rms_norm_reference(x, weight, eps)
    return encode_record(y, scale, dtype, amax_pending, slot, saturation), rstd


@torch.library.impl(LIB, "rms_norm_backward", "CompositeExplicitAutograd")
def _rms_norm_backward(grad_y, x, rstd, weight, output_mask):
    check_rms_norm_backward_args(grad_y, x, rstd, weight, output_mask)
    dx, dweight = ref.rms_norm_backward_reference(grad_y, x, rstd, weight, output_mask)
    return None if dx is None else dx.contiguous(), dweight


def _rms_fake(x, dtype):
    return _codes_like(x, dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.register_fake("fp8state::rms_norm_quantize_fp8")
def _rms_norm_quantize_fp8_fake(x, weight, eps, scale, dtype):
    return _rms_fake(x, dtype)


@torch.library.register_fake("fp8state::rms_norm_quantize_fp8_record_amax")
def _rms_norm_quantize_fp8_record_amax_fake(x, weight, eps, scale, amax_pending, slot, dtype, saturation=None):
    return _rms_fake(x, dtype)


@torch.library.register_fake("fp8state::rms_norm_backward")
def _rms_norm_backward_fake(grad_y, x, rstd, weight, output_mask):
    check_rms_norm_backward_args(grad_y, x, rstd, weight, output_mask)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else None,
        x.new_empty((x.shape[-1],), dtype=torch.float32) if output_mask[1] else None,
    )
