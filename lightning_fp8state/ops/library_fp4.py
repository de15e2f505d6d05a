"""The packed-FP4 ops of the ``fp8state`` library: schemas, input checks, reference and fake kernels.

Same conventions as the FP8 ops in :mod:`.library`: schemas in Python, "expected X, got Y"
``ValueError``s, the pure-torch reference registered as ``CompositeExplicitAutograd``
(contiguous outputs), fake kernels for ``torch.compile``. ``layout`` is ``"nvfp4"`` or
``"mxfp4"``; the bit-level rules are in :mod:`lightning_fp8state.formats`.
"""

from __future__ import annotations

import torch

from ..config import CENTER_MOMENTUM_MAX, require_that
from ..formats import FP4_LAYOUTS
from . import reference_fp4 as ref
from .library import LIB, _check_pending, _check_scalar
from .reference import canonical_nan

__all__ = ["check_fp4_quantize_args", "check_update_centers_args"]

LIB.define("quantize_fp4(Tensor x, Tensor scale, Tensor? center, str layout) -> (Tensor, Tensor)")
LIB.define(
    "quantize_fp4_record_amax(Tensor x, Tensor scale, Tensor(a!) amax_pending, int slot, str layout) "
    "-> (Tensor, Tensor)"
)
LIB.define(
    "quantize_fp4_centered_record(Tensor x, Tensor scale, Tensor center, Tensor(a!) amax_pending, "
    "Tensor(b!) center_max, Tensor(c!) center_min, int slot, str layout) -> (Tensor, Tensor)"
)
LIB.define(
    "dequantize_fp4(Tensor packed, Tensor block_scales, Tensor descale, Tensor? center, str layout, "
    "ScalarType dtype) -> Tensor"
)
LIB.define(
    "update_centers(Tensor(a!) center, Tensor(b!) center_max, Tensor(c!) center_min, Tensor commit_mask, "
    "float momentum) -> ()"
)

_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_layout(layout: str) -> int:
    require_that(layout in FP4_LAYOUTS, "layout", repr(layout), f"one of {sorted(FP4_LAYOUTS)}")
    return FP4_LAYOUTS[layout].block_size


def _check_center(center: torch.Tensor | None, k: int, device: torch.device) -> None:
    if center is None:
        return
    require_that(center.dtype == torch.float32, "center.dtype", center.dtype, "torch.float32")
    require_that(
        tuple(center.shape) == (k,), "center.shape", tuple(center.shape), f"({k},) (one value per channel of x)"
    )
    require_that(center.device == device, "center.device", center.device, str(device))


def check_fp4_quantize_args(x: torch.Tensor, scale: torch.Tensor, center: torch.Tensor | None, layout: str) -> None:
    """Validate the arguments shared by the FP4 quantize ops."""
    block = _check_layout(layout)
    require_that(x.dtype in _IN_DTYPES, "x.dtype", x.dtype, f"one of {list(_IN_DTYPES)}")
    require_that(x.dim() >= 1, "x.dim()", x.dim(), ">= 1")
    k = x.shape[-1]
    require_that(k % block == 0, "x.shape[-1]", k, f"a multiple of {block} (the {layout} block size)")
    _check_scalar("scale", scale, x.device)
    _check_center(center, k, x.device)


def _check_center_stats(center_max, center_min, slot: int, k: int, device: torch.device) -> None:
    for name, t in (("center_max", center_max), ("center_min", center_min)):
        require_that(t.dtype == torch.float32, f"{name}.dtype", t.dtype, "torch.float32")
        require_that(t.dim() == 2, f"{name}.dim()", t.dim(), "2 ([owners, channels])")
        require_that(t.device == device, f"{name}.device", t.device, str(device))
    require_that(
        center_min.shape == center_max.shape, "center_min.shape", tuple(center_min.shape), tuple(center_max.shape)
    )
    require_that(0 <= slot < center_max.shape[0], "slot", slot, f"0 <= slot < {center_max.shape[0]}")
    require_that(center_max.shape[1] >= k, "center_max.shape[1]", center_max.shape[1], f">= {k} (x's channels)")


def check_update_centers_args(center, center_max, center_min, commit_mask, momentum) -> None:
    """Validate the batched center update's arguments."""
    require_that(center.dim() == 2, "center.dim()", center.dim(), "2 ([owners, channels])")
    n, device = center.shape[0], center.device
    for name, t in (("center", center), ("center_max", center_max), ("center_min", center_min)):
        require_that(t.dtype == torch.float32, f"{name}.dtype", t.dtype, "torch.float32")
        require_that(t.device == device, f"{name}.device", t.device, str(device))
        require_that(t.shape == center.shape, f"{name}.shape", tuple(t.shape), tuple(center.shape))
    require_that(commit_mask.dtype == torch.bool, "commit_mask.dtype", commit_mask.dtype, "torch.bool")
    require_that(tuple(commit_mask.shape) == (n,), "commit_mask.shape", tuple(commit_mask.shape), f"({n},)")
    require_that(commit_mask.device == device, "commit_mask.device", commit_mask.device, str(device))
    require_that(
        0.0 < momentum <= CENTER_MOMENTUM_MAX, "momentum", momentum, f"0 < momentum <= {CENTER_MOMENTUM_MAX:g}"
    )


def _record_stats(x, center, amax_pending, slot, center_max=None, center_min=None) -> None:
    cell = amax_pending.narrow(0, slot, 1)
    cell.copy_(canonical_nan(torch.maximum(cell, ref.fp4_amax_reference(x, center).reshape(1))))
    if center_max is None or x.numel() == 0:
        return
    k = x.shape[-1]
    row_max = center_max[slot, :k]
    row_min = center_min[slot, :k]
    hi, lo = ref.fold_center_stats_reference(row_max, row_min, x)
    row_max.copy_(hi)
    row_min.copy_(lo)


@torch.library.impl(LIB, "quantize_fp4", "CompositeExplicitAutograd")
def _quantize_fp4(x, scale, center, layout):
    check_fp4_quantize_args(x, scale, center, layout)
    return ref.quantize_fp4_reference(x, scale, center, layout)


@torch.library.impl(LIB, "quantize_fp4_record_amax", "CompositeExplicitAutograd")
def _quantize_fp4_record_amax(x, scale, amax_pending, slot, layout):
    check_fp4_quantize_args(x, scale, None, layout)
    _check_pending(amax_pending, slot, x.device)
    _record_stats(x, None, amax_pending, slot)
    return ref.quantize_fp4_reference(x, scale, None, layout)


@torch.library.impl(LIB, "quantize_fp4_centered_record", "CompositeExplicitAutograd")
def _quantize_fp4_centered_record(x, scale, center, amax_pending, center_max, center_min, slot, layout):
    check_fp4_quantize_args(x, scale, center, layout)
    _check_pending(amax_pending, slot, x.device)
    _check_center_stats(center_max, center_min, slot, x.shape[-1], x.device)
    _record_stats(x, center, amax_pending, slot, center_max, center_min)
    return ref.quantize_fp4_reference(x, scale, center, layout)


@torch.library.impl(LIB, "dequantize_fp4", "CompositeExplicitAutograd")
def _dequantize_fp4(packed, block_scales, descale, center, layout, dtype):
    block = _check_layout(layout)
    require_that(packed.dtype == torch.uint8, "packed.dtype", packed.dtype, "torch.uint8")
    require_that(packed.dim() >= 1, "packed.dim()", packed.dim(), ">= 1")
    k = 2 * packed.shape[-1]
    require_that(k % block == 0, "2 * packed.shape[-1]", k, f"a multiple of {block} (the {layout} block size)")
    want_dtype = FP4_LAYOUTS[layout].block_scale_dtype
    require_that(block_scales.dtype == want_dtype, "block_scales.dtype", block_scales.dtype, str(want_dtype))
    want_shape = (*packed.shape[:-1], k // block)
    require_that(tuple(block_scales.shape) == want_shape, "block_scales.shape", tuple(block_scales.shape), want_shape)
    require_that(block_scales.device == packed.device, "block_scales.device", block_scales.device, str(packed.device))
    require_that(dtype in _IN_DTYPES, "dtype", dtype, f"one of {list(_IN_DTYPES)}")
    _check_scalar("descale", descale, packed.device)
    _check_center(center, k, packed.device)
    return ref.dequantize_fp4_reference(packed, block_scales, descale, center, layout, dtype).contiguous()


@torch.library.impl(LIB, "update_centers", "CompositeExplicitAutograd")
def _update_centers(center, center_max, center_min, commit_mask, momentum) -> None:
    check_update_centers_args(center, center_max, center_min, commit_mask, momentum)
    ref.update_centers_reference(center, center_max, center_min, commit_mask, momentum)


def _fake_fp4_outputs(x, layout):
    lay = FP4_LAYOUTS[layout]
    k = x.shape[-1]
    packed = x.new_empty((*x.shape[:-1], k // 2), dtype=torch.uint8)
    scales = x.new_empty((*x.shape[:-1], k // lay.block_size), dtype=lay.block_scale_dtype)
    return packed, scales


@torch.library.register_fake("fp8state::quantize_fp4")
def _quantize_fp4_fake(x, scale, center, layout):
    return _fake_fp4_outputs(x, layout)


@torch.library.register_fake("fp8state::quantize_fp4_record_amax")
def _quantize_fp4_record_amax_fake(x, scale, amax_pending, slot, layout):
    return _fake_fp4_outputs(x, layout)


@torch.library.register_fake("fp8state::quantize_fp4_centered_record")
def _quantize_fp4_centered_record_fake(x, scale, center, amax_pending, center_max, center_min, slot, layout):
    return _fake_fp4_outputs(x, layout)


@torch.library.register_fake("fp8state::dequantize_fp4")
def _dequantize_fp4_fake(packed, block_scales, descale, center, layout, dtype):
    return packed.new_empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=dtype)


@torch.library.register_fake("fp8state::update_centers")
def _update_centers_fake(center, center_max, center_min, commit_mask, momentum):
    return None
