"""The fused SwiGLU + FP8 quantize ops of the ``fp8state`` library and the SwiGLU's backward:
schemas, checks, reference and fake kernels (numerics: :mod:`.reference_swiglu`; CUDA:
``csrc/swiglu_ops.cu``).

``h [..., 2I]`` is a fused gate/up projection's output (gate first); the forward returns the
codes of ``silu(gate) * up`` (``[..., I]``, contiguous), ``swiglu_backward`` the gradient of
``h`` (``[..., 2I]``, ``h``'s dtype, contiguous). Any even width: the kernel takes rows that are
not whole 16-byte chunks on a scalar path, with the same numerics.
"""

from __future__ import annotations

import torch

from ..config import require_that
from . import reference_swiglu as ref
from .library import (
    _FP8_DTYPES,
    _IN_DTYPES,
    LIB,
    SATURATION_ARG,
    _check_pending,
    _check_saturation,
    _check_scalar,
    encode_record,
)

__all__ = ["check_swiglu_args", "check_swiglu_backward_args", "swiglu_width"]

LIB.define("swiglu_quantize_fp8(Tensor h, Tensor scale, ScalarType dtype) -> Tensor")
LIB.define(
    "swiglu_quantize_fp8_record_amax(Tensor h, Tensor scale, Tensor(a!) amax_pending, int slot, ScalarType dtype, "
    f"{SATURATION_ARG}) -> Tensor"
)
LIB.define("swiglu_backward(Tensor grad_y, Tensor h) -> Tensor")


def swiglu_width(h: torch.Tensor) -> int:
    """``I``: the width of ``h``'s halves (checked: ``h`` of a float dtype, its last dim a positive
    even number)."""
    require_that(h.dtype in _IN_DTYPES, "h.dtype", h.dtype, f"one of {list(_IN_DTYPES)}")
    require_that(h.dim() >= 1, "h.dim()", h.dim(), ">= 1")
    width = h.shape[-1]
    require_that(width > 0 and width % 2 == 0, "h.shape[-1]", width, "a positive even number (gate and up halves)")
    return width // 2


def check_swiglu_args(h: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Validate the fused SwiGLU's arguments."""
    swiglu_width(h)
    require_that(dtype in _FP8_DTYPES, "dtype", dtype, f"one of {list(_FP8_DTYPES)}")
    _check_scalar("scale", scale, h.device)


def check_swiglu_backward_args(grad_y: torch.Tensor, h: torch.Tensor) -> None:
    """Validate ``swiglu_backward``'s arguments (``grad_y`` of ``h``'s dtype, ``h.shape[:-1] + (I,)``)."""
    inter = swiglu_width(h)
    require_that(grad_y.dtype == h.dtype, "grad_y.dtype", grad_y.dtype, str(h.dtype))
    want = (*h.shape[:-1], inter)
    require_that(tuple(grad_y.shape) == want, "grad_y.shape", tuple(grad_y.shape), str(want))
    require_that(grad_y.device == h.device, "grad_y.device", grad_y.device, str(h.device))


@torch.library.impl(LIB, "swiglu_quantize_fp8", "CompositeExplicitAutograd")
def _swiglu_quantize_fp8(h, scale, dtype):
    check_swiglu_args(h, scale, dtype)
    return ref.swiglu_quantize_fp8_reference(h, scale, dtype)[0]


@torch.library.impl(LIB, "swiglu_quantize_fp8_record_amax", "CompositeExplicitAutograd")
def _swiglu_quantize_fp8_record_amax(h, scale, amax_pending, slot, dtype, saturation=None):
    check_swiglu_args(h, scale, dtype)
    _check_pending(amax_pending, slot, h.device)
    _check_saturation(saturation, amax_pending, h.device)
    return encode_record(ref.swiglu_f32(h), scale, dtype, amax_pending, slot, saturation)


@torch.library.impl(LIB, "swiglu_backward", "CompositeExplicitAutograd")
def _swiglu_backward(grad_y, h):
    check_swiglu_backward_args(grad_y, h)
    return ref.swiglu_backward_reference(grad_y, h).contiguous()


def _codes_fake(h, dtype):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2), dtype=dtype)


@torch.library.register_fake("fp8state::swiglu_quantize_fp8")
def _swiglu_quantize_fp8_fake(h, scale, dtype):
    return _codes_fake(h, dtype)


@torch.library.register_fake("fp8state::swiglu_quantize_fp8_record_amax")
def _swiglu_quantize_fp8_record_amax_fake(h, scale, amax_pending, slot, dtype, saturation=None):
    return _codes_fake(h, dtype)


@torch.library.register_fake("fp8state::swiglu_backward")
def _swiglu_backward_fake(grad_y, h):
    check_swiglu_backward_args(grad_y, h)
    return torch.empty_like(h, memory_format=torch.contiguous_format)
