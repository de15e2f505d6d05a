"""The ``fp8state`` ops of the stateless scalings (``fp8_current``, ``fp8_rowwise``): schemas,
input checks, reference and fake kernels (numerics: :mod:`.reference_dynamic`).

Each returns the codes with the scale, descale and amax it derived from its input, so the
caller pairs them in the call's snapshot. The reference (``CompositeExplicitAutograd``) serves
every device but CUDA, where the kernels of ``csrc/dynamic_ops.cu`` (``TORCH_LIBRARY_IMPL(fp8state,
CUDA, m)``) take over, bitwise the reference (``tests/ops/test_cuda_dynamic.py``).
``current_scale`` is the first half of ``quantize_fp8_current`` on its own (the amax and the
scales, no codes): grad_output's encode takes it before one cast-transpose pass.
"""

from __future__ import annotations

import torch

from ..config import MARGIN_MAX, require_that
from . import cuda
from . import reference_dynamic as ref
from .library import _FP8_DTYPES, _IN_DTYPES, LIB

__all__ = ["current_scale", "quantize_fp8_colwise", "quantize_fp8_current", "quantize_fp8_rowwise"]

LIB.define("quantize_fp8_current(Tensor x, ScalarType dtype, int margin) -> (Tensor, Tensor, Tensor, Tensor)")
LIB.define("quantize_fp8_rowwise(Tensor x, ScalarType dtype, int margin) -> (Tensor, Tensor, Tensor, Tensor)")
LIB.define("current_scale(Tensor x, ScalarType dtype, int margin) -> (Tensor, Tensor, Tensor)")
LIB.define("quantize_fp8_colwise(Tensor x, ScalarType dtype, int margin) -> (Tensor, Tensor, Tensor, Tensor)")


def _check(x: torch.Tensor, dtype: torch.dtype, margin: int, *, rows: bool) -> None:
    require_that(x.dtype in _IN_DTYPES, "x.dtype", x.dtype, f"one of {list(_IN_DTYPES)}")
    require_that(dtype in _FP8_DTYPES, "dtype", dtype, f"one of {list(_FP8_DTYPES)}")
    require_that(0 <= margin <= MARGIN_MAX, "margin", margin, f"an integer >= 0 and <= {MARGIN_MAX}")
    if rows:
        require_that(x.dim() == 2, "x.dim()", x.dim(), "2")


# CUDA: csrc/dynamic_ops.cu (the amax, the scale on the device, then the quantize)
@torch.library.impl(LIB, "quantize_fp8_current", "CompositeExplicitAutograd")
def _quantize_fp8_current(x: torch.Tensor, dtype: torch.dtype, margin: int):
    _check(x, dtype, margin, rows=False)
    q, scale, descale, amax = ref.quantize_fp8_current_reference(x, dtype, margin)
    return q.contiguous(), scale, descale, amax


# CUDA: csrc/dynamic_ops.cu (one pass per row: its amax, then its codes from registers)
@torch.library.impl(LIB, "quantize_fp8_rowwise", "CompositeExplicitAutograd")
def _quantize_fp8_rowwise(x: torch.Tensor, dtype: torch.dtype, margin: int):
    _check(x, dtype, margin, rows=True)
    q, scale, descale, amax = ref.quantize_fp8_rowwise_reference(x, dtype, margin)
    return q.contiguous(), scale, descale, amax


# CUDA: csrc/dynamic_ops.cu (the columns' amaxes, their scales, then 128 x 128 tiles encoded
# and written transposed)
@torch.library.impl(LIB, "quantize_fp8_colwise", "CompositeExplicitAutograd")
def _quantize_fp8_colwise(x: torch.Tensor, dtype: torch.dtype, margin: int):
    _check(x, dtype, margin, rows=True)
    return ref.quantize_fp8_colwise_reference(x, dtype, margin)


@torch.library.impl(LIB, "current_scale", "CompositeExplicitAutograd")
def _current_scale(x: torch.Tensor, dtype: torch.dtype, margin: int):
    _check(x, dtype, margin, rows=False)
    return ref.current_scale_reference(x, dtype, margin)


@torch.library.register_fake("fp8state::current_scale")
def _current_scale_fake(x, dtype, margin):
    scalar = x.new_empty((), dtype=torch.float32)
    return scalar, torch.empty_like(scalar), torch.empty_like(scalar)


@torch.library.register_fake("fp8state::quantize_fp8_current")
def _quantize_fp8_current_fake(x, dtype, margin):
    scalar = x.new_empty((), dtype=torch.float32)
    q = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return q, scalar, torch.empty_like(scalar), torch.empty_like(scalar)


@torch.library.register_fake("fp8state::quantize_fp8_rowwise")
def _quantize_fp8_rowwise_fake(x, dtype, margin):
    col = x.new_empty((x.shape[0], 1), dtype=torch.float32)
    q = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return q, col, torch.empty_like(col), torch.empty_like(col)


@torch.library.register_fake("fp8state::quantize_fp8_colwise")
def _quantize_fp8_colwise_fake(x, dtype, margin):
    col = x.new_empty((x.shape[1], 1), dtype=torch.float32)
    q = x.new_empty((x.shape[1], x.shape[0]), dtype=dtype)
    return q, col, torch.empty_like(col), torch.empty_like(col)


def quantize_fp8_current(x: torch.Tensor, dtype: torch.dtype, margin: int = 0):
    """Per-tensor current scaling of ``x``: ``(codes, scale, descale, amax)`` (0-d float32)."""
    cuda.load_for(x)
    return torch.ops.fp8state.quantize_fp8_current(x, dtype, margin)


def current_scale(x: torch.Tensor, dtype: torch.dtype, margin: int = 0):
    """``(scale, descale, amax)`` of per-tensor current scaling of ``x`` (0-d float32), no codes."""
    cuda.load_for(x)
    return torch.ops.fp8state.current_scale(x, dtype, margin)


def quantize_fp8_rowwise(x: torch.Tensor, dtype: torch.dtype, margin: int = 0):
    """Rowwise scaling of the 2-D ``x``: ``(codes, scale, descale, amax)``, each ``[R, 1]``."""
    cuda.load_for(x)
    return torch.ops.fp8state.quantize_fp8_rowwise(x, dtype, margin)


def quantize_fp8_colwise(x: torch.Tensor, dtype: torch.dtype, margin: int = 0):
    """Each column of the 2-D ``x [R, C]`` scaled by its own amax, codes transposed: ``(codes
    [C, R], scale, descale, amax)``, the last three ``[C, 1]``; bitwise
    ``quantize_fp8_rowwise(x.t().contiguous())`` without the high-precision transpose."""
    cuda.load_for(x)
    return torch.ops.fp8state.quantize_fp8_colwise(x, dtype, margin)
