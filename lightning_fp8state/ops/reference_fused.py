"""Pure-torch references of the fused prologue + FP8 quantize ops (``csrc/fused_ops.cu``).

A prologue is the op that produces a Linear's input: the LayerNorm before ``qkv`` and ``fc``,
the GELU before ``out``. Fused, the prologue writes FP8 codes straight away (and records
their amax) instead of a 16- or 32-bit tensor that a quantize pass then reads back.

``gelu``: exactly torch's GELU (erf form) in the input's dtype, then
:func:`quantize_fp8_reference`: the fused kernel computes ``(x * 0.5) * (1 + erf(x / sqrt 2))``
in float32 as torch's CUDA kernel does and rounds to the input dtype, so on a GPU the fused
op equals ``F.gelu`` followed by ``quantize_fp8`` bit for bit (on the CPU the reference
*is* that composition).

``layer_norm``: our own LayerNorm numerics, defined by the kernel's fixed reduction order and
reproduced here operation for operation, so that kernel and reference agree bit for bit:

- row of ``d`` elements, in chunks of 16 bytes (``V`` = 4 float32 or 8 bfloat16/float16);
  thread ``t`` of ``LN_THREADS`` sums chunks ``t, t + LN_THREADS, ...`` in order, each chunk's
  elements in order, in float32, from 0;
- the 32 lanes of a warp combine by XOR butterfly (offsets 16, 8, 4, 2, 1), then the warps'
  sums are added in warp order;
- ``mean = sum / d``; the second pass sums ``(x - mean)^2`` the same way (separate multiply
  and add, no fused multiply-add); ``rstd = 1 / sqrt(sumsq / d + eps)``; each operation one
  correctly rounded IEEE float32 operation (``eps`` rounded to float32 first);
- ``y = ((x - mean) * rstd) * weight + bias`` (each step rounded), rounded to ``x``'s dtype.

The statistics (``mean``, ``rstd``, float32, shape ``x.shape[:-1] + (1,)``, the canonical NaN
for a row holding a NaN) are what
``aten.native_layer_norm_backward`` takes; it differs from torch's own LayerNorm only in the
last bits of the float32 results (torch reduces in another order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import amax_reference, canonical_nan, quantize_fp8_reference

__all__ = [
    "LN_THREADS",
    "gelu_quantize_fp8_reference",
    "layer_norm_quantize_fp8_reference",
    "layer_norm_reference",
]

LN_THREADS = 256  # threads that share one row in the kernel (8 warps)
_WARP = 32


def _chunk_width(dtype: torch.dtype) -> int:
    return 16 // dtype.itemsize


def _row_sum(v: torch.Tensor, width: int, threads: int = LN_THREADS) -> torch.Tensor:
    """Float32 sum over the last dim of ``v [M, d]`` in the kernel's order (module docstring),
    ``threads`` (whole warps) sharing a row."""
    m, d = v.shape
    nchunks = d // width
    # Threads without a chunk hold +0.0, and adding +0.0 changes no sum here (a sum from +0.0
    # is never -0.0): with fewer chunks than threads, only the first power of two of threads
    # that covers them takes part, and butterfly offsets past it add zeros.
    if nchunks < threads:
        threads = min(threads, 1 << (nchunks - 1).bit_length())
    rounds = -(-nchunks // threads)
    chunks = v.reshape(m, nchunks, width)
    pad = rounds * threads - nchunks
    if pad:
        chunks = torch.cat([chunks, chunks.new_zeros(m, pad, width)], dim=1)
    chunks = chunks.reshape(m, rounds, threads, width)
    thread = torch.arange(threads, device=v.device)
    acc = v.new_zeros(m, threads)
    for k in range(rounds):
        valid = (thread + k * threads) < nchunks
        for e in range(width):
            acc = torch.where(valid, acc + chunks[:, k, :, e], acc)
    lanes = min(threads, _WARP)
    warps = acc.reshape(m, threads // lanes, lanes)
    lane = torch.arange(lanes, device=v.device)
    for off in (16, 8, 4, 2, 1):
        if off < lanes:
            warps = warps + warps[..., lane ^ off]
    total = warps[:, 0, 0]
    for w in range(1, threads // lanes):
        total = total + warps[:, w, 0]
    return total


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim in the fused kernel's numerics: ``(y, mean, rstd)``.

    ``y`` has ``x``'s dtype and shape; ``mean`` and ``rstd`` are float32 of shape
    ``x.shape[:-1] + (1,)``.
    """
    d = x.shape[-1]
    width = _chunk_width(x.dtype)
    v = x.detach().reshape(-1, d).to(torch.float32)
    mean = _row_sum(v, width) / d
    diff = v - mean[:, None]
    var = _row_sum(diff * diff, width) / d
    # the square root in float64, rounded once: correctly rounded like the kernel's __fsqrt_rn
    # (torch's float32 CPU sqrt is not: off by an ulp for ~15 % of inputs on AVX-512)
    root = torch.sqrt((var + eps).to(torch.float64)).to(torch.float32)
    rstd = torch.div(torch.ones_like(var), root)
    y = diff * rstd[:, None]
    if weight is not None:
        y = y * weight.detach().to(torch.float32)
    if bias is not None:
        y = y + bias.detach().to(torch.float32)
    stats_shape = (*x.shape[:-1], 1)
    mean, rstd = (canonical_nan(t).reshape(stats_shape) for t in (mean, rstd))
    return y.to(x.dtype).reshape(x.shape), mean, rstd


def layer_norm_quantize_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`layer_norm_reference` then :func:`quantize_fp8_reference`:
    ``(codes, mean, rstd, amax)`` with ``amax = max|y|`` (float32 scalar, canonical NaN)."""
    y, mean, rstd = layer_norm_reference(x, weight, bias, eps)
    return quantize_fp8_reference(y, scale, dtype).contiguous(), mean, rstd, amax_reference(y)


def gelu_quantize_fp8_reference(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.gelu(x)`` (erf form, in ``x``'s dtype) then :func:`quantize_fp8_reference`:
    ``(codes, amax)`` with ``amax = max|gelu(x)|``."""
    y = gelu_reference(x)
    return quantize_fp8_reference(y, scale, dtype).contiguous(), amax_reference(y)


def gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x)`` (erf form, in ``x``'s dtype): what the fused GELU op encodes."""
    return F.gelu(x.detach())
