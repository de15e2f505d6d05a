"""Scaled FP8 matrix products: torch._scaled_mm where the GPU has it, an exact emulation elsewhere."""

from __future__ import annotations

import functools

import torch

from .. import ops

__all__ = ["scaled_matmul", "scaled_mm_available"]


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def scaled_mm_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 on ``device`` (CUDA compute capability >= 8.9)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


def _emulated(a: torch.Tensor, b: torch.Tensor, descale_a, descale_b, out_dtype, bias) -> torch.Tensor:
    # Products of FP8 values are exact in float32; accumulate in float32, then apply the
    # paired descales once and add the bias, as _scaled_mm's epilogue does, and round once
    # to the output dtype.
    acc = (a.to(torch.float32) @ b.to(torch.float32)) * (descale_a.reshape(()) * descale_b.reshape(()))
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor, through ``ops.transpose_fp8`` when ``t`` is the transposed
    view of a contiguous 2-D tensor."""
    if t.t().is_contiguous():
        return ops.transpose_fp8(t.t())
    return t.contiguous()


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    descale_a: torch.Tensor,
    descale_b: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str = "auto",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a @ b) * descale_a * descale_b (+ bias)`` for FP8 ``a [M, K]`` and ``b [K, N]``.

    ``bias`` (``[N]``) is added in float32 before the one rounding to ``out_dtype`` (in
    cuBLASLt's epilogue for 16-bit outputs: no separate pass over the output).

    ``backend``: ``auto`` (``_scaled_mm`` when available and the shapes allow it),
    ``emulated`` or ``scaled_mm`` (raises where it cannot run).
    """
    use_mm = backend == "scaled_mm" or (
        backend == "auto"
        and scaled_mm_available(a.device)
        and a.shape[1] % 16 == 0
        and b.shape[1] % 16 == 0
        and not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2)
    )
    if not use_mm:
        return _emulated(a, b, descale_a, descale_b, out_dtype, bias)
    # _scaled_mm wants a row-major and b column-major. The backward's operands arrive the
    # other way round (transposed views of contiguous tensors): re-lay them out with the
    # byte transpose kernel, not torch's generic strided copy.
    a = a if a.is_contiguous() else _row_major(a)
    b = b if b.t().is_contiguous() else _row_major(b.t()).t()
    scales = {"scale_a": descale_a.reshape(()), "scale_b": descale_b.reshape(())}
    if bias is None:
        return torch._scaled_mm(a, b, **scales, out_dtype=out_dtype)
    if out_dtype in (torch.bfloat16, torch.float16):  # the epilogue takes a 16-bit bias only
        return torch._scaled_mm(a, b, **scales, bias=bias.to(out_dtype), out_dtype=out_dtype)
    return torch._scaled_mm(a, b, **scales, out_dtype=out_dtype) + bias.to(out_dtype)
