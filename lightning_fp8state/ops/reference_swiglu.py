"""Pure-torch references of the SwiGLU prologue ops (``csrc/swiglu_ops.cu``), bit for bit.

SwiGLU is the activation between a Llama MLP's fused ``gate_up`` projection and its ``down``
projection: ``h [..., 2I]`` holds the gate in its first half and the up projection in its
second, and ``down`` reads ``silu(gate) * up`` of width ``I``. Fused, one pass reads ``h`` and
writes the FP8 codes of that product (and records their amax).

Numerics, every float32 operation one correctly rounded IEEE operation, in this order (the
kernel computes the same with ``__fadd_rn``-style intrinsics: no fused multiply-add, and the
shared ``csrc/swiglu_math.cuh`` holds its one definition, compiled for the host in the tests):

- ``g``, ``u``: the gate and up elements converted to float32 (exact);
- ``e = exp(-g)`` by :func:`exp_f32`, a float32 exponential built from those operations only,
  so that the CPU and the GPU give the same bits (torch's CPU ``exp`` and CUDA's ``expf`` are
  each accurate to an ulp or two, but not equal to each other);
- ``silu = g / (1 + e)``; ``y = silu * u``: float32, never rounded to ``h``'s dtype; the codes
  are ``y`` quantized (:func:`~.reference.quantize_fp8_reference`: one rounding, to FP8) and the
  record is ``max |y|``.

``silu(-inf)`` is NaN (``-inf / inf``), as torch's ``F.silu`` gives. The result is not bitwise
torch's ``F.silu(gate) * up`` (another exponential; in 16-bit dtypes torch also rounds ``silu``
and the product to the dtype): ``tests/unit/test_prologue_rms_swiglu.py`` bounds the difference.

:func:`exp_f32`: with ``k = rint(v * log2(e))`` and ``r = (v - k * LN2_HI) - k * LN2_LO``
(Cody and Waite's two-part ``ln 2``: ``k * LN2_HI`` is exact), ``exp(r)`` is the degree-7
Taylor polynomial in Horner form (coefficients ``1/n!`` rounded to float32), scaled by ``2^k`` in
two exact-power steps ``2^(k // 2)``, then ``2^(k - k // 2)`` (one rounding, into the subnormals
or to infinity where the result lies there). ``v`` is clamped to ``[-104, 89]`` first (beyond,
the result is 0 or infinity already); a NaN stays NaN. Within about 2 ulp of the true value.

The backward (:func:`swiglu_backward_reference`), from ``e`` as above: ``den = 1 + e``,
``sig = 1 / den``, ``silu = g / den``; ``du = dy * silu``;
``dg = (dy * u) * (sig * (1 + g * (1 - sig)))``, each rounded to ``h``'s dtype (the canonical
NaN for a NaN).
"""

from __future__ import annotations

import torch

from .reference import amax_reference, canonical_nan, quantize_fp8_reference

__all__ = [
    "exp_f32",
    "silu_f32",
    "swiglu_backward_reference",
    "swiglu_f32",
    "swiglu_quantize_fp8_reference",
]

# float32 constants, written as their exact values (csrc/swiglu_math.cuh spells the same bits)
LOG2E = float.fromhex("0x1.715476p+0")
LN2_HI = float.fromhex("0x1.62e4p-1")  # 15 significant bits: k * LN2_HI is exact for |k| <= 150
LN2_LO = float.fromhex("0x1.7f7d1cp-20")
# 1/n! for n = 7 .. 2 (Horner's order); the polynomial ends with + r + 1
TAYLOR = tuple(
    float.fromhex(h)
    for h in ("0x1.a01a02p-13", "0x1.6c16c2p-10", "0x1.111112p-7", "0x1.555556p-5", "0x1.555556p-3", "0x1p-1")
)
EXP_LOW, EXP_HIGH = -104.0, 89.0  # exp(-104) rounds to 0, exp(89) to infinity


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2^k`` as float32 for integer ``k`` in ``[-126, 127]`` (its bits, exactly)."""
    return ((k + 127) << 23).view(torch.float32)


def exp_f32(v: torch.Tensor) -> torch.Tensor:
    """``exp(v)`` of float32 ``v`` in the kernels' float32 operations (module docstring)."""
    nan = torch.isnan(v)
    w = torch.where(nan, torch.zeros((), dtype=v.dtype, device=v.device), v).clamp(EXP_LOW, EXP_HIGH)
    k = torch.round(w * LOG2E)  # round half to even, as rintf
    r = (w - k * LN2_HI) - k * LN2_LO
    p = r * TAYLOR[0] + TAYLOR[1]
    for c in TAYLOR[2:]:
        p = p * r + c
    p = p * r + 1.0
    p = p * r + 1.0
    ki = k.to(torch.int32)
    k1 = torch.div(ki, 2, rounding_mode="trunc")
    y = (p * _pow2(k1)) * _pow2(ki - k1)
    return torch.where(nan, v, y)


def silu_f32(g: torch.Tensor) -> torch.Tensor:
    """``g / (1 + exp(-g))`` of float32 ``g`` (:func:`exp_f32`)."""
    return g / (exp_f32(-g) + 1.0)


def _halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of ``h``'s last dim, in float32."""
    gate, up = h.detach().chunk(2, dim=-1)
    return gate.to(torch.float32), up.to(torch.float32)


def swiglu_f32(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in float32, ``[..., I]`` from ``h [..., 2I]`` (what the fused op encodes)."""
    g, u = _halves(h)
    return silu_f32(g) * u


def swiglu_quantize_fp8_reference(
    h: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`swiglu_f32` then :func:`~.reference.quantize_fp8_reference`: ``(codes, amax)``,
    ``amax = max |y|`` (float32 scalar, the canonical NaN if any is NaN)."""
    y = swiglu_f32(h)
    return quantize_fp8_reference(y, scale, dtype).contiguous(), amax_reference(y)


def swiglu_backward_reference(grad_y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The gradient of ``h`` (``[..., 2I]``, ``h``'s dtype) from that of ``silu(gate) * up``
    (``grad_y [..., I]``), in the module docstring's order."""
    g, u = _halves(h)
    dy = grad_y.detach().to(torch.float32)
    den = exp_f32(-g) + 1.0
    sig = torch.ones_like(den) / den
    silu = g / den
    dsilu = sig * ((g * (1.0 - sig)) + 1.0)
    dg = (dy * u) * dsilu
    du = dy * silu
    return canonical_nan(torch.cat([dg, du], dim=-1).to(h.dtype))
