"""The fp8state custom ops: call these, never the reference functions, on the hot path.

On CPU (and on CUDA until the ``csrc/`` kernels are built) they run the pure-torch
reference; with the CUDA extension loaded the same calls run the fused kernels.
"""

from __future__ import annotations

import functools

import torch

from . import cuda
from . import library as _library  # noqa: F401  (defines the schemas and kernels)
from . import library_fp4 as _library_fp4  # noqa: F401  (the FP4 schemas and kernels)
from . import library_fused as _library_fused  # noqa: F401  (the fused prologue + quantize ops)
from . import library_rms as _library_rms  # noqa: F401  (the RMSNorm prologue and its backward)
from . import library_swiglu as _library_swiglu  # noqa: F401  (the SwiGLU prologue and its backward)
from . import reference_rms as _reference_rms
from .reference import (
    amax_reference,
    clip_count_reference,
    column_sum_reference,
    dequantize_fp8_reference,
    quantize_fp8_reference,
    transpose_fp8_reference,
    update_scales_reference,
)
from .reference_fp4 import (
    block_scale_values_reference,
    center_stats_reference,
    dequantize_fp4_reference,
    e2m1_decode_reference,
    e2m1_encode_reference,
    fold_center_stats_reference,
    fp4_amax_reference,
    pack_fp4_reference,
    quantize_fp4_reference,
    unpack_fp4_reference,
    update_centers_reference,
)

__all__ = [
    "amax_reference",
    "block_scale_values_reference",
    "clip_count_reference",
    "cuda",
    "center_stats_reference",
    "column_sum_reference",
    "dequantize_fp4",
    "dequantize_fp4_reference",
    "dequantize_fp8",
    "dequantize_fp8_reference",
    "e2m1_decode_reference",
    "e2m1_encode_reference",
    "fold_center_stats_reference",
    "fp4_amax_reference",
    "gelu_quantize_fp8",
    "layer_norm_backward",
    "layer_norm_quantize_fp8",
    "pack_fp4_reference",
    "quantize_fp4",
    "quantize_fp4_centered_record",
    "quantize_fp4_record_amax",
    "quantize_fp4_reference",
    "quantize_fp8",
    "quantize_fp8_record_amax",
    "quantize_fp8_reference",
    "quantize_fp8_t_record_amax",
    "rms_norm_backward",
    "rms_norm_quantize_fp8",
    "swiglu_backward",
    "swiglu_quantize_fp8",
    "transpose_fp8",
    "transpose_fp8_reference",
    "unpack_fp4_reference",
    "update_centers",
    "update_centers_reference",
    "update_scales",
    "update_scales_reference",
]

_ops = torch.ops.fp8state


_on_cuda = cuda.load_for  # builds/loads the kernels on first CUDA use


def _dispatching(name: str, reference):
    """The public entry of op ``name``: its signature and documentation are its CPU
    reference's (written once there); the call goes to the op, on the CUDA kernel once built."""
    op = getattr(_ops, name)

    @functools.wraps(reference)
    def call(first, *args, **kwargs):
        _on_cuda(first)
        return op(first, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Encode ``x`` as FP8 with ``scale``; records nothing (the recompute path)."""
    _on_cuda(x)
    return _ops.quantize_fp8(x, scale, dtype)


def quantize_fp8_record_amax(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_pending: torch.Tensor,
    slot: int,
    dtype: torch.dtype,
    saturation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode ``x`` as FP8 and fold ``max|x|`` into ``amax_pending[slot]`` (NaN sticks); with
    ``saturation`` (int64 ``[2, amax_pending.numel()]``), add the elements that clip and the
    elements encoded to its column ``slot`` (see ``library.SATURATION_ARG``)."""
    _on_cuda(x)
    return _ops.quantize_fp8_record_amax(x, scale, amax_pending, slot, dtype, saturation)


def gelu_quantize_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    amax_pending: torch.Tensor | None = None,
    slot: int = 0,
    saturation: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quantize_fp8(F.gelu(x), scale, dtype)`` in one pass (bit for bit the same codes);
    with ``amax_pending``, ``max|gelu(x)|`` is folded into ``amax_pending[slot]``."""
    _on_cuda(x)
    if amax_pending is None:
        return _ops.gelu_quantize_fp8(x, scale, dtype)
    return _ops.gelu_quantize_fp8_record_amax(x, scale, amax_pending, slot, dtype, saturation)


def layer_norm_quantize_fp8(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor,
    dtype: torch.dtype,
    amax_pending: torch.Tensor | None = None,
    slot: int = 0,
    saturation: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim (numerics: :mod:`.reference_fused`) written straight as FP8
    codes: ``(codes, mean, rstd)``; with ``amax_pending``, ``max|y|`` is folded into
    ``amax_pending[slot]``."""
    _on_cuda(x)
    if amax_pending is None:
        return _ops.layer_norm_quantize_fp8(x, weight, bias, eps, scale, dtype)
    return _ops.layer_norm_quantize_fp8_record_amax(x, weight, bias, eps, scale, amax_pending, slot, dtype, saturation)


def rms_norm_quantize_fp8(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor,
    dtype: torch.dtype,
    amax_pending: torch.Tensor | None = None,
    slot: int = 0,
    saturation: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (numerics: :mod:`.reference_rms`; ``weight`` float32 or None)
    written straight as FP8 codes: ``(codes, rstd)``; with ``amax_pending``, ``max|y|`` is folded
    into ``amax_pending[slot]``."""
    _on_cuda(x)
    if amax_pending is None:
        return _ops.rms_norm_quantize_fp8(x, weight, eps, scale, dtype)
    return _ops.rms_norm_quantize_fp8_record_amax(x, weight, eps, scale, amax_pending, slot, dtype, saturation)


# Gradients (dx, dweight) of the RMSNorm from its rstd: the reference's signature and numerics.
rms_norm_backward = _dispatching("rms_norm_backward", _reference_rms.rms_norm_backward_reference)


def swiglu_quantize_fp8(
    h: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    amax_pending: torch.Tensor | None = None,
    slot: int = 0,
    saturation: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 codes of ``silu(gate) * up`` (``[..., I]``) from ``h = [gate, up]`` (``[..., 2I]``),
    computed in float32 (numerics: :mod:`.reference_swiglu`) and rounded once; with
    ``amax_pending``, the product's ``max|y|`` is folded into ``amax_pending[slot]``."""
    _on_cuda(h)
    if amax_pending is None:
        return _ops.swiglu_quantize_fp8(h, scale, dtype)
    return _ops.swiglu_quantize_fp8_record_amax(h, scale, amax_pending, slot, dtype, saturation)


def swiglu_backward(grad_y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The gradient of ``h`` (``[..., 2I]``, ``h``'s dtype) from that of ``silu(gate) * up``
    (``grad_y [..., I]``, ``h``'s dtype); numerics: :mod:`.reference_swiglu`."""
    _on_cuda(h)
    return _ops.swiglu_backward(grad_y, h)


def quantize_fp8_t_record_amax(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_pending: torch.Tensor,
    slot: int,
    dtype: torch.dtype,
    column_sum: bool,
    saturation: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 2-D ``x`` encoded as FP8 both ways, ``(codes [R, C], codes transposed [C, R], sums)``,
    from one read of ``x``; ``max|x|`` folded into ``amax_pending[slot]``. With ``column_sum``,
    ``sums`` is the float32 column sum of ``x`` (order: :func:`column_sum_reference`), else empty."""
    _on_cuda(x)
    return _ops.quantize_fp8_t_record_amax(x, scale, amax_pending, slot, dtype, column_sum, saturation)


def layer_norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    output_mask: tuple[bool, bool, bool] | list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients ``(dx, dgamma, dbeta)`` of the LayerNorm over the last dim of ``x`` (numerics:
    :mod:`.reference_ln`) from its ``(mean, rstd)`` and the output's gradient ``grad_y``; an
    output whose ``output_mask`` entry is False is None. ``dgamma``/``dbeta`` are float32."""
    _on_cuda(x)
    return _ops.layer_norm_backward(grad_y, x, mean, rstd, weight, list(output_mask))


def dequantize_fp8(q: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decode FP8 ``q`` with ``descale`` into ``dtype``."""
    _on_cuda(q)
    return _ops.dequantize_fp8(q, descale, dtype)


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    """FP8 ``q[R, C]`` as a new contiguous ``[C, R]`` tensor (the layout cuBLASLt's FP8 GEMM
    wants for the backward's operands), byte for byte."""
    _on_cuda(q)
    return _ops.transpose_fp8(q)


# Advance all owners selected by ``commit_mask`` in one batched update (in place).
update_scales = _dispatching("update_scales", update_scales_reference)


# -- packed FP4 (layouts and rounding: lightning_fp8state.formats) -------------------------


def quantize_fp4(
    x: torch.Tensor, scale: torch.Tensor, layout: str, center: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x [..., K]`` as packed E2M1 ``[..., K/2]`` plus block scales; records nothing.

    With ``center`` ([K], float32) the centered variant encodes ``x - center``.
    """
    _on_cuda(x)
    return _ops.quantize_fp4(x, scale, center, layout)


def quantize_fp4_record_amax(
    x: torch.Tensor, scale: torch.Tensor, amax_pending: torch.Tensor, slot: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp4` that also folds ``max|x|`` into ``amax_pending[slot]`` (NaN sticks)."""
    _on_cuda(x)
    return _ops.quantize_fp4_record_amax(x, scale, amax_pending, slot, layout)


def quantize_fp4_centered_record(
    x: torch.Tensor,
    scale: torch.Tensor,
    center: torch.Tensor,
    amax_pending: torch.Tensor,
    center_max: torch.Tensor,
    center_min: torch.Tensor,
    slot: int,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Centered :func:`quantize_fp4` that records ``max|x - center|`` into ``amax_pending[slot]``
    and folds ``x``'s per-channel max/min into row ``slot`` of ``center_max``/``center_min``."""
    _on_cuda(x)
    return _ops.quantize_fp4_centered_record(x, scale, center, amax_pending, center_max, center_min, slot, layout)


def dequantize_fp4(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    descale: torch.Tensor,
    layout: str,
    dtype: torch.dtype,
    center: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode packed E2M1 with its block scales and the paired ``descale`` (+ ``center``)."""
    _on_cuda(packed)
    return _ops.dequantize_fp4(packed, block_scales, descale, center, layout, dtype)


def update_centers(
    center: torch.Tensor,
    center_max: torch.Tensor,
    center_min: torch.Tensor,
    commit_mask: torch.Tensor,
    momentum: float,
) -> None:
    """Advance the running centers of all owners selected by ``commit_mask`` (in place)."""
    _on_cuda(center)
    _ops.update_centers(center, center_max, center_min, commit_mask, float(momentum))
