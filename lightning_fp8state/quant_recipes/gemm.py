"""Per-tensor scaled FP8 matrix products (the GEMM of fp8_delayed and fp8_current):
torch._scaled_mm where the GPU has it, an exact emulation elsewhere. Moved unchanged from
``nn/gemm.py`` (which re-exports it)."""

from __future__ import annotations

import functools
import warnings

import torch

from .. import ops
from ..config import require_that

__all__ = ["scaled_matmul", "scaled_mm_available", "warn_unless_e4m3"]


def warn_unless_e4m3(recipe: str, config, gemm: str) -> None:
    """Warn where ``recipe``'s formats are not both E4M3: cuBLASLt's ``gemm`` (rowwise,
    block-scaled) FP8 GEMM takes E4M3 operands only, so the recipe's GEMMs with an E5M2 operand
    run as a float32 emulation: the run is correct and far slower than bf16. QuantConfig's
    ``auto`` formats give these recipes E4M3 (their ``formats``); a config that names E5M2 (or
    was made for another recipe and ``dataclasses.replace``-d) lands here."""
    formats = {"quant.forward_format": config.forward_format, "quant.backward_format": config.backward_format}
    e5m2 = [key for key, name in formats.items() if name != "e4m3"]
    if e5m2:
        warnings.warn(
            f"recipe={recipe!r} with {', '.join(f'{k}={formats[k]!r}' for k in e5m2)}: cuBLASLt's {gemm} FP8 GEMM "
            "takes E4M3 operands only, so every GEMM with one of these operands runs as a float32 emulation, much "
            f"slower than bf16 (docs/PERFORMANCE.md). Set them to 'e4m3', as configs/quant/{recipe}.yaml does",
            UserWarning,
            stacklevel=4,
        )


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


def _pad_inner(a: torch.Tensor, b: torch.Tensor, align: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``a [M, K]`` and ``b [K, N]`` with K padded by zero codes to a multiple of ``align``: ``a``
    row-major, ``b`` column-major (the layouts ``_scaled_mm`` takes)."""
    m, k = a.shape
    kp = -(-k // align) * align
    a_p = a.new_zeros((m, kp))
    a_p[:, :k] = a
    b_p = b.new_zeros((b.shape[1], kp)).t()
    b_p[:k] = b
    return a_p, b_p


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_MM_DEVICES: dict[torch.device, bool] = {}  # device -> scaled_mm_available (one lookup per call)


def _mm_device(device: torch.device) -> bool:
    ok = _MM_DEVICES.get(device)
    if ok is None:
        ok = _MM_DEVICES[device] = scaled_mm_available(device)
    return ok


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 0 else t.reshape(())  # the frozen descales are 0-d views already


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    descale_a: torch.Tensor,
    descale_b: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str = "auto",
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a @ b) * descale_a * descale_b (+ bias)`` for FP8 ``a [M, K]`` and ``b [K, N]``.

    ``bias`` (``[N]``) is added in float32 before the one rounding to ``out_dtype`` (in
    cuBLASLt's epilogue for 16-bit outputs: no separate pass over the output; a bias of
    another dtype is converted first, or pass it converted: the training step calls this
    several times a step with the same bias).

    ``backend``: ``auto`` (``_scaled_mm`` when available and the shapes allow it),
    ``emulated`` or ``scaled_mm`` (raises where it cannot run).

    ``out`` (contiguous ``[M, N]`` of ``out_dtype``; returned): written in place, by the GEMM
    itself where it runs on the device, so a caller assembling products into one tensor (the
    experts' ``[E, out, in]`` weight gradient) holds no second copy of them.
    """
    if out is not None:
        require_that(
            out.shape == (a.shape[0], b.shape[1]) and out.dtype == out_dtype and out.is_contiguous(),
            "out",
            f"a contiguous {out_dtype} tensor of shape {(a.shape[0], b.shape[1])}",
            f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}",
        )
    # (on the host path of every linear call, 3-4 times a step: each check is kept cheap)
    use_mm = backend == "scaled_mm" or (
        backend == "auto"
        and b.shape[1] % 16 == 0
        and _mm_device(a.device)
        and not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2)
    )
    if not use_mm:
        return _into(_emulated(a, b, descale_a, descale_b, out_dtype, bias), out)
    if a.shape[1] % 16:
        # cuBLASLt wants K a multiple of 16: a weight gradient over a token count that is not
        # (an expert's share of the routed tokens) pads both operands' K with zero codes, whose
        # products add exact zeros (the float32 emulation was ~5x slower than bf16 at Mixtral's
        # expert shapes on the H200)
        a, b = _pad_inner(a, b)
    # _scaled_mm wants a row-major and b column-major. The backward's operands arrive the
    # other way round (transposed views of contiguous tensors): re-lay them out with the
    # byte transpose kernel, not torch's generic strided copy.
    if not a.is_contiguous():
        a = _row_major(a)
    b_t = b.t()
    if not b_t.is_contiguous():
        b = _row_major(b_t).t()
    sa, sb = _scalar(descale_a), _scalar(descale_b)
    if bias is None:
        if out is not None:
            return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype, out=out)
        return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype)
    if out_dtype in _SIXTEEN_BIT:  # the epilogue takes a bias of the output's 16-bit dtype only
        bias = bias if bias.dtype == out_dtype else bias.to(out_dtype)
        return _into(torch._scaled_mm(a, b, sa, sb, bias, out_dtype=out_dtype), out)
    return _into(torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype) + bias.to(out_dtype), out)


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return result if out is None else out.copy_(result)
