"""Pure-torch references of the RMSNorm prologue ops (``csrc/fused_ops.cu``, ``csrc/ln_ops.cu``),
reduction orders included: kernel and reference agree bit for bit.

The RMSNorm before a Llama block's ``q/k/v`` and ``gate/up`` projections, fused into the input's
FP8 quantize like the LayerNorm of :mod:`.reference_fused`, with the same row layout and the
same fixed order of its one sum. Every float32 operation is one correctly rounded IEEE
operation (no fused multiply-add):

- row of ``d`` elements in chunks of 16 bytes (``V`` = 4 float32 or 8 bfloat16/float16); thread
  ``t`` of ``LN_THREADS`` sums ``x * x`` over chunks ``t, t + LN_THREADS, ...`` in order, each
  chunk's elements in order, from 0; warps by XOR butterfly, then the warps' sums in warp order
  (:func:`.reference_fused._row_sum`);
- ``rstd = 1 / sqrt(sumsq / d + eps)`` (``eps`` rounded to float32 first, the square root
  correctly rounded);
- ``y = round(round(x * rstd) * weight)``, ``round`` to ``x``'s dtype: the Hugging Face Llama
  convention (``weight * (x.float() * rstd).to(x.dtype)``), normalized in float32, rounded to the
  input's dtype, then scaled by the weight (given as float32) and rounded again. With a weight
  in ``x``'s dtype the product of two values of that dtype is exact in float32, so ``y`` equals
  that formula's bits whenever ``rstd`` does; torch's ``nn.RMSNorm`` rounds once, after the
  weight (so it may differ in the last bit of a 16-bit ``y``), and a float32 weight beside a
  16-bit ``x`` makes Hugging Face's result float32 where ``y`` is rounded to ``x``'s dtype.
  ``rstd`` itself differs from torch's ``rsqrt(mean(x * x) + eps)`` in the last bits (another
  summation order; a division rather than ``rsqrt``). Measured (``tests/unit/
  test_prologue_rms_swiglu.py``, d = 2048): ``rstd`` within 2 ulp of torch's; a float32 ``y``
  within about 3 ulp of Hugging Face's (a fifth of the elements differ); a 16-bit ``y`` with a
  weight in its dtype equal to Hugging Face's but on a few elements in ten thousand, by one or
  two units in the last place; against ``nn.RMSNorm`` in 16 bits, a quarter of the elements one
  unit apart (its single rounding).

The fused op returns ``rstd`` (float32, shape ``x.shape[:-1] + (1,)``; the canonical NaN for a
row holding a NaN, 0 for a row whose squares overflow) for the backward, which is the LayerNorm
backward's kernel with no mean (:mod:`.reference_ln`: same geometry, same orders):

- per element ``xhat = x * rstd``, ``g = dy * weight`` (``g = dy`` without weight);
- per row ``s = sum(g * xhat)`` in the backward's row order; ``dx = (g - xhat * (s / d)) * rstd``,
  rounded to ``x``'s dtype;
- ``dweight = sum over rows of dy * xhat`` in the backward's two-stage column order (float32).

The backward treats the roundings of the forward as the identity (the gradient of
``x * rstd * weight``).

Rows the kernels do not take (a width that is not whole chunks, or past the widest) go through
:func:`rms_norm_unfused` and :func:`rms_norm_unfused_backward`: the same formulas in torch's own
reductions (``rsqrt(mean(x * x) + eps)``, as Hugging Face writes it), no fixed order.
"""

from __future__ import annotations

import torch

from .reference import amax_reference, canonical_nan, quantize_fp8_reference
from .reference_fused import _chunk_width, _row_sum
from .reference_ln import _sum_partials, _tile_column_sums, backward_geometry

__all__ = [
    "rms_norm_backward_reference",
    "rms_norm_quantize_fp8_reference",
    "rms_norm_reference",
    "rms_norm_unfused",
    "rms_norm_unfused_backward",
]


def _rstd(v: torch.Tensor, eps: float, width: int) -> torch.Tensor:
    """``1 / sqrt(sumsq / d + eps)`` per row of float32 ``v [M, d]`` (module docstring)."""
    ms = _row_sum(v * v, width) / v.shape[-1]
    # the square root in float64, rounded once: correctly rounded like the kernel's __fsqrt_rn
    root = torch.sqrt((ms + eps).to(torch.float64)).to(torch.float32)
    return torch.div(torch.ones_like(ms), root)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim in the fused kernel's numerics: ``(y, rstd)``; ``y`` has ``x``'s
    dtype and shape, ``rstd`` is float32 of shape ``x.shape[:-1] + (1,)``."""
    d = x.shape[-1]
    v = x.detach().reshape(-1, d).to(torch.float32)
    rstd = _rstd(v, eps, _chunk_width(x.dtype))
    y = (v * rstd[:, None]).to(x.dtype)
    if weight is not None:
        y = (y.to(torch.float32) * weight.detach().to(torch.float32)).to(x.dtype)
    y = canonical_nan(y).reshape(x.shape)
    return y, canonical_nan(rstd).reshape(*x.shape[:-1], 1)


def rms_norm_quantize_fp8_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_reference` then :func:`~.reference.quantize_fp8_reference`:
    ``(codes, rstd, amax)`` with ``amax = max |y|`` (float32 scalar, the canonical NaN)."""
    y, rstd = rms_norm_reference(x, weight, eps)
    return quantize_fp8_reference(y, scale, dtype).contiguous(), rstd, amax_reference(y)


def rms_norm_backward_reference(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    output_mask: tuple[bool, bool] | list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight)`` of the RMSNorm over the last dim of ``x`` (module docstring); an output
    whose ``output_mask`` entry is False is None."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    geo = backward_geometry(m, n, x.dtype)
    dy = grad_y.detach().reshape(m, n).to(torch.float32)
    xhat = x.detach().reshape(m, n).to(torch.float32) * rstd.detach().reshape(m, 1).to(torch.float32)
    dx = dweight = None
    if output_mask[0]:
        g = dy if weight is None else dy * weight.detach().to(torch.float32)
        count = torch.full((m,), float(n), dtype=torch.float32, device=dy.device)  # tensor / tensor: a true division
        b = torch.div(_row_sum(g * xhat, geo.width, geo.threads), count)
        dx = (g - xhat * b[:, None]) * rstd.detach().reshape(m, 1).to(torch.float32)
        dx = canonical_nan(dx.to(x.dtype)).reshape(x.shape)
    if output_mask[1]:
        dweight = canonical_nan(_sum_partials(_tile_column_sums(dy * xhat, geo)))
    return dx, dweight


def rms_norm_unfused(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm in torch's reductions, for rows no kernel takes: ``(y, rstd)`` as
    :func:`rms_norm_reference` returns them, with ``rstd = rsqrt(mean(x * x) + eps)`` (Hugging
    Face's expression: in float32, bitwise its result)."""
    v = x.detach().to(torch.float32)
    rstd = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    y = (v * rstd).to(x.dtype)
    if weight is not None:
        y = (y.to(torch.float32) * weight.detach().to(torch.float32)).to(x.dtype)
    return y, rstd.reshape(*x.shape[:-1], 1)


def rms_norm_unfused_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    output_mask: tuple[bool, bool] | list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of :func:`rms_norm_unfused` (the module docstring's formulas, torch's
    reductions): ``(dx, dweight)``, None where ``output_mask`` says so; ``dweight`` float32."""
    d = x.shape[-1]
    dy = grad_y.detach().reshape(-1, d).to(torch.float32)
    rs = rstd.detach().reshape(-1, 1).to(torch.float32)
    xhat = x.detach().reshape(-1, d).to(torch.float32) * rs
    dx = dweight = None
    if output_mask[0]:
        g = dy if weight is None else dy * weight.detach().to(torch.float32)
        dx = ((g - xhat * (g * xhat).mean(-1, keepdim=True)) * rs).to(x.dtype).reshape(x.shape)
    if output_mask[1]:
        dweight = (dy * xhat).sum(0)
    return dx, dweight
