"""The fused prologue + FP8 quantize ops of the ``fp8state`` library: schemas, checks,
reference and fake kernels (numerics: :mod:`.reference_fused`; CUDA: ``csrc/fused_ops.cu``),
and the LayerNorm's backward (numerics: :mod:`.reference_ln`; CUDA: ``csrc/ln_ops.cu``).

Same conventions as :mod:`.library`. The LayerNorm ops return ``(codes, mean, rstd)``; the
statistics feed ``layer_norm_backward``, which returns ``(dx, dgamma, dbeta)`` (None where
``output_mask`` says so).
"""

from __future__ import annotations

import torch

from ..config import require_that
from . import reference_fused as ref
from .library import (
    _IN_DTYPES,
    LIB,
    SATURATION_ARG,
    _check_pending,
    _check_saturation,
    check_quantize_args,
    encode_record,
)
from .reference_ln import layer_norm_backward_reference

__all__ = ["check_layer_norm_args", "check_layer_norm_backward_args", "layer_norm_max_width", "layer_norm_width_ok"]

LIB.define("gelu_quantize_fp8(Tensor x, Tensor scale, ScalarType dtype) -> Tensor")
LIB.define(
    "gelu_quantize_fp8_record_amax(Tensor x, Tensor scale, Tensor(a!) amax_pending, int slot, ScalarType dtype, "
    f"{SATURATION_ARG}) -> Tensor"
)
LIB.define(
    "layer_norm_quantize_fp8(Tensor x, Tensor? weight, Tensor? bias, float eps, Tensor scale, ScalarType dtype) "
    "-> (Tensor, Tensor, Tensor)"
)
LIB.define(
    "layer_norm_quantize_fp8_record_amax(Tensor x, Tensor? weight, Tensor? bias, float eps, Tensor scale, "
    f"Tensor(a!) amax_pending, int slot, ScalarType dtype, {SATURATION_ARG}) -> (Tensor, Tensor, Tensor)"
)
LIB.define(
    "layer_norm_backward(Tensor grad_y, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, bool[3] output_mask) "
    "-> (Tensor?, Tensor?, Tensor?)"
)

_MAX_CHUNKS_PER_THREAD = 8  # the kernel keeps a row in registers: at most 8 chunks of 16 bytes a thread


def layer_norm_max_width(dtype: torch.dtype) -> int:
    """The widest row the fused LayerNorm takes for ``dtype`` (8192 float32, 16384 16-bit)."""
    return _MAX_CHUNKS_PER_THREAD * ref.LN_THREADS * ref._chunk_width(dtype)


def layer_norm_width_ok(dtype: torch.dtype, d: int) -> bool:
    """Whether the fused LayerNorm takes rows of ``d`` elements of ``dtype`` (whole 16-byte
    chunks, at most :func:`layer_norm_max_width`)."""
    return d % ref._chunk_width(dtype) == 0 and 0 < d <= layer_norm_max_width(dtype)


def _check_row_width(x: torch.Tensor) -> int:
    """The width of ``x``'s rows (its last dim), checked against the LayerNorm kernels'."""
    require_that(x.dim() >= 1, "x.dim()", x.dim(), ">= 1")
    d = x.shape[-1]
    require_that(
        layer_norm_width_ok(x.dtype, d),
        "x.shape[-1]",
        d,
        f"a positive multiple of {ref._chunk_width(x.dtype)} up to {layer_norm_max_width(x.dtype)} for {x.dtype}",
    )
    return d


def check_layer_norm_args(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, scale, dtype
) -> None:
    """Validate the fused LayerNorm's arguments (the quantize ones, the row width, the affine)."""
    check_quantize_args(x, scale, dtype)
    _check_row_width(x)
    require_that(eps >= 0, "eps", eps, ">= 0")
    _check_affine("weight", weight, x)
    _check_affine("bias", bias, x)


def _check_affine(name: str, t: torch.Tensor | None, x: torch.Tensor) -> None:
    if t is None:
        return
    d = x.shape[-1]
    require_that(t.dtype == torch.float32, f"{name}.dtype", t.dtype, "torch.float32")
    require_that(tuple(t.shape) == (d,), f"{name}.shape", tuple(t.shape), f"({d},) (one value per channel of x)")
    require_that(t.device == x.device, f"{name}.device", t.device, str(x.device))


def check_layer_norm_backward_args(grad_y, x, mean, rstd, weight, output_mask) -> None:
    """Validate ``layer_norm_backward``'s arguments (``x``'s width as the forward's, ``grad_y``
    like ``x``, one float32 statistic per row, the optional float32 weight)."""
    require_that(x.dtype in _IN_DTYPES, "x.dtype", x.dtype, f"one of {list(_IN_DTYPES)}")
    d = _check_row_width(x)
    require_that(grad_y.dtype == x.dtype, "grad_y.dtype", grad_y.dtype, str(x.dtype))
    require_that(grad_y.shape == x.shape, "grad_y.shape", tuple(grad_y.shape), tuple(x.shape))
    require_that(grad_y.device == x.device, "grad_y.device", grad_y.device, str(x.device))
    rows = x.numel() // d
    for name, t in (("mean", mean), ("rstd", rstd)):
        require_that(t.dtype == torch.float32, f"{name}.dtype", t.dtype, "torch.float32")
        require_that(t.numel() == rows, f"{name}.numel()", t.numel(), f"{rows} (one per row of x)")
        require_that(t.device == x.device, f"{name}.device", t.device, str(x.device))
    _check_affine("weight", weight, x)
    require_that(len(output_mask) == 3, "len(output_mask)", len(output_mask), "3")


@torch.library.impl(LIB, "gelu_quantize_fp8", "CompositeExplicitAutograd")
def _gelu_quantize_fp8(x, scale, dtype):
    check_quantize_args(x, scale, dtype)
    return ref.gelu_quantize_fp8_reference(x, scale, dtype)[0]


@torch.library.impl(LIB, "gelu_quantize_fp8_record_amax", "CompositeExplicitAutograd")
def _gelu_quantize_fp8_record_amax(x, scale, amax_pending, slot, dtype, saturation=None):
    check_quantize_args(x, scale, dtype)
    _check_pending(amax_pending, slot, x.device)
    _check_saturation(saturation, amax_pending, x.device)
    return encode_record(ref.gelu_reference(x), scale, dtype, amax_pending, slot, saturation)


@torch.library.impl(LIB, "layer_norm_quantize_fp8", "CompositeExplicitAutograd")
def _layer_norm_quantize_fp8(x, weight, bias, eps, scale, dtype):
    check_layer_norm_args(x, weight, bias, eps, scale, dtype)
    return ref.layer_norm_quantize_fp8_reference(x, weight, bias, eps, scale, dtype)[:3]


@torch.library.impl(LIB, "layer_norm_quantize_fp8_record_amax", "CompositeExplicitAutograd")
def _layer_norm_quantize_fp8_record_amax(x, weight, bias, eps, scale, amax_pending, slot, dtype, saturation=None):
    check_layer_norm_args(x, weight, bias, eps, scale, dtype)
    _check_pending(amax_pending, slot, x.device)
    _check_saturation(saturation, amax_pending, x.device)
    y, mean, rstd = ref.layer_norm_reference(x, weight, bias, eps)
    return encode_record(y, scale, dtype, amax_pending, slot, saturation), mean, rstd


@torch.library.impl(LIB, "layer_norm_backward", "CompositeExplicitAutograd")
def _layer_norm_backward(grad_y, x, mean, rstd, weight, output_mask):
    check_layer_norm_backward_args(grad_y, x, mean, rstd, weight, output_mask)
    dx, dgamma, dbeta = layer_norm_backward_reference(grad_y, x, mean, rstd, weight, output_mask)
    return None if dx is None else dx.contiguous(), dgamma, dbeta


def _codes_like(x, dtype):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def _ln_fake(x, dtype):
    stats = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    return _codes_like(x, dtype), stats, torch.empty_like(stats)


@torch.library.register_fake("fp8state::gelu_quantize_fp8")
def _gelu_quantize_fp8_fake(x, scale, dtype):
    return _codes_like(x, dtype)


@torch.library.register_fake("fp8state::gelu_quantize_fp8_record_amax")
def _gelu_quantize_fp8_record_amax_fake(x, scale, amax_pending, slot, dtype, saturation=None):
    return _codes_like(x, dtype)


@torch.library.register_fake("fp8state::layer_norm_quantize_fp8")
def _layer_norm_quantize_fp8_fake(x, weight, bias, eps, scale, dtype):
    return _ln_fake(x, dtype)


@torch.library.register_fake("fp8state::layer_norm_quantize_fp8_record_amax")
def _layer_norm_quantize_fp8_record_amax_fake(x, weight, bias, eps, scale, amax_pending, slot, dtype, saturation=None):
    return _ln_fake(x, dtype)


@torch.library.register_fake("fp8state::layer_norm_backward")
def _layer_norm_backward_fake(grad_y, x, mean, rstd, weight, output_mask):
    check_layer_norm_backward_args(grad_y, x, mean, rstd, weight, output_mask)
    column = x.new_empty((x.shape[-1],), dtype=torch.float32)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else None,
        column if output_mask[1] else None,
        torch.empty_like(column) if output_mask[2] else None,
    )
