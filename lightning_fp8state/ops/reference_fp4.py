"""Pure-torch reference of the packed-FP4 ops: the oracle every FP4 kernel must match bit for bit.

Each function follows the FP4 invariants written down in ``lightning_fp8state.formats``
(E2M1 rounding and packing, NVFP4 and MXFP4 block scales, the centered variant, the NaN and
signed-zero rules). Nothing here relies on behaviour torch leaves to the device or version:
every NaN written is canonical, block scales are built from bit patterns or from casts of
in-range values only, divisions are tensor by tensor (torch's CUDA division by a Python
scalar multiplies by the reciprocal instead), and max/min of signed values order ``-0 < +0``
through integer keys.
"""

from __future__ import annotations

import torch

from ..formats import E2M1_VALUES, E4M3, MXFP4, NVFP4, fp4_layout
from .reference import canonical_nan

__all__ = [
    "block_scale_values_reference",
    "center_stats_reference",
    "dequantize_fp4_reference",
    "e2m1_decode_reference",
    "e2m1_encode_reference",
    "fold_center_stats_reference",
    "fp4_amax_reference",
    "pack_fp4_reference",
    "quantize_fp4_reference",
    "unpack_fp4_reference",
    "update_centers_reference",
]

# Decision thresholds between consecutive E2M1 magnitudes (the midpoints), and whether a
# value exactly on the threshold rounds up: ties go to the even code, so up at 0.75
# (code 1 -> 2), 1.75 (3 -> 4) and 3.5 (5 -> 6), down at 0.25, 1.25, 2.5 and 5.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_DECODE = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float32)


def e2m1_encode_reference(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of float32 ``y``: nearest, ties to even, saturating at 6,
    sign bit from ``y``, NaN -> code 0."""
    a = y.abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for threshold, up_on_tie in _THRESHOLDS:
        mag += (a >= threshold if up_on_tie else a > threshold).to(torch.uint8)
    negative = torch.signbit(y) & ~torch.isnan(y)
    return mag | (negative.to(torch.uint8) << 3)


def e2m1_decode_reference(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8, only the low nibble is read)."""
    return _DECODE.to(codes.device)[(codes & 0xF).long()]


def pack_fp4_reference(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes ``[..., K]`` (K even) into bytes ``[..., K / 2]``: element ``2i`` in the
    low nibble, ``2i + 1`` in the high nibble."""
    c = codes.to(torch.uint8) & 0xF
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_fp4_reference(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_fp4_reference`: bytes ``[..., N]`` to codes ``[..., 2N]``."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _order_key(t: torch.Tensor) -> torch.Tensor:
    """int32 keys of float32 ``t`` that order like the values, with ``-0 < +0`` (sign-magnitude
    to two's complement: negative patterns get their magnitude bits flipped). The map is its
    own inverse. A positive NaN's key lies above +inf's, a negative NaN's below -inf's."""
    b = t.contiguous().view(torch.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _from_key(k: torch.Tensor) -> torch.Tensor:
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).view(torch.float32)


def _signed_max(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise max with ``-0 < +0``; the canonical NaN if either is NaN."""
    m = _from_key(torch.maximum(_order_key(a), _order_key(b)))
    return canonical_nan(torch.where(torch.isnan(a) | torch.isnan(b), float("nan"), m))


def _signed_min(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise min with ``-0 < +0``; the canonical NaN if either is NaN."""
    m = _from_key(torch.minimum(_order_key(a), _order_key(b)))
    return canonical_nan(torch.where(torch.isnan(a) | torch.isnan(b), float("nan"), m))


def _pow2_f32(n: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**n`` for integer ``n`` in [-127, 127], built from the bit pattern."""
    n = n.to(torch.int32)
    normal = (n + 127).clamp(min=1) << 23
    bits = torch.where(n == -127, torch.full_like(n, 1 << 22), normal)  # 2**-127 is subnormal
    return bits.view(torch.float32)


def _centered(x: torch.Tensor, center: torch.Tensor | None) -> torch.Tensor:
    xf = x.to(torch.float32)
    return xf if center is None else xf - center.to(torch.float32)


def fp4_amax_reference(x: torch.Tensor, center: torch.Tensor | None = None) -> torch.Tensor:
    """The amax a quantize call records: ``max|x - center|`` (float32 scalar; the canonical NaN
    if any element is NaN; 0 if empty)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return canonical_nan(_centered(x.detach(), center).abs().amax())


def center_stats_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (last dimension) max and min of ``x`` over every leading dimension, float32.
    ``-0 < +0``; a channel holding a NaN gets the canonical NaN in both. ``x`` must have at
    least one row."""
    rows = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
    keys = _order_key(rows)
    nan = torch.isnan(rows).any(dim=0)
    hi = torch.where(nan, float("nan"), _from_key(keys.amax(dim=0)))
    lo = torch.where(nan, float("nan"), _from_key(keys.amin(dim=0)))
    return canonical_nan(hi), canonical_nan(lo)


def fold_center_stats_reference(
    center_max_row: torch.Tensor, center_min_row: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's pending ``(max, min)`` rows after folding in ``x``'s per-channel max/min:
    elementwise max/min with ``-0 < +0``, the canonical NaN where either side is NaN."""
    hi, lo = center_stats_reference(x)
    return _signed_max(center_max_row, hi), _signed_min(center_min_row, lo)


def quantize_fp4_reference(
    x: torch.Tensor, scale: torch.Tensor, center: torch.Tensor | None, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x [..., K]`` as packed E2M1 with ``layout``'s block scales and tensor scale
    ``scale``; with ``center``, encode ``x - center`` (the centered variant).

    Returns:
        ``(packed uint8 [..., K / 2], block_scales [..., K / block_size])``; block scales
        are ``float8_e4m3fn`` (NVFP4) or ``float8_e8m0fnu`` (MXFP4).
    """
    lay = fp4_layout(layout)
    xf = _centered(x, center)
    s = scale.reshape(()).to(torch.float32)
    k = xf.shape[-1]
    blocks = xf.reshape(*xf.shape[:-1], k // lay.block_size, lay.block_size)
    if lay is NVFP4:
        a = blocks.abs().amax(dim=-1)
        six = torch.full((), 6.0, dtype=torch.float32, device=a.device)  # a true division, on every device
        v = (a / six) * s
        # E4M3 of v only where 0 < v (cast of an in-range value: v <= 448 after the clamp);
        # v <= 0 (also -0, from a negative or zero S) gives +0, NaN gives the NaN code 0x7F.
        cast = v.clamp(max=E4M3.max).to(E4M3.dtype).view(torch.uint8)
        zero = torch.zeros((), dtype=torch.uint8, device=a.device)
        nan_code = torch.full((), 0x7F, dtype=torch.uint8, device=a.device)
        codes = torch.where(torch.isnan(v), nan_code, torch.where(v > 0, cast, zero))
        block_scales = codes.view(E4M3.dtype)
        sb = block_scales.to(torch.float32)
        enc = torch.where(sb == 0, torch.zeros_like(sb), s / sb)
        y = blocks * enc.unsqueeze(-1)
    else:  # MXFP4
        u = blocks * s
        a = u.abs().amax(dim=-1)
        # floor(log2(a)) from the exponent field: a float32 subnormal (field 0) gives a value
        # below -126 - 2, which clamps to -127 like every a < 2**-124 (no frexp of subnormals).
        field = (a.contiguous().view(torch.int32) >> 23) & 0xFF
        x_exp = (field - 127 - 2).clamp(-127, 127)
        x_exp = torch.where(a == 0, torch.full_like(x_exp, -127), x_exp)
        x_exp = torch.where(torch.isinf(a), torch.full_like(x_exp, 127), x_exp)
        nan_block = torch.isnan(a)
        x_exp = torch.where(nan_block, torch.zeros_like(x_exp), x_exp)
        codes = torch.where(nan_block, torch.full_like(x_exp, 255), x_exp + 127)
        block_scales = codes.to(torch.uint8).view(MXFP4.block_scale_dtype)
        y = u * _pow2_f32(-x_exp).unsqueeze(-1)
        y = torch.where(nan_block.unsqueeze(-1), torch.full_like(y, float("nan")), y)
    codes = e2m1_encode_reference(y).reshape(xf.shape)
    return pack_fp4_reference(codes), block_scales.contiguous()


def dequantize_fp4_reference(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    descale: torch.Tensor,
    center: torch.Tensor | None,
    layout: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode packed E2M1 ``[..., K / 2]``: ``float32(e * block_scale) * descale`` (+ ``center``),
    rounded once to ``dtype``."""
    lay = fp4_layout(layout)
    e = e2m1_decode_reference(unpack_fp4_reference(packed))
    k = e.shape[-1]
    sb = block_scale_values_reference(block_scales, layout).unsqueeze(-1)
    d = (e.reshape(*e.shape[:-1], k // lay.block_size, lay.block_size) * sb).reshape(e.shape)
    d = d * descale.reshape(()).to(torch.float32)
    if center is not None:
        d = d + center.to(torch.float32)
    return canonical_nan(d.to(dtype))


def block_scale_values_reference(block_scales: torch.Tensor, layout: str) -> torch.Tensor:
    """float32 values of block scales: E4M3 decoded exactly (NaN codes 0x7F/0xFF -> NaN),
    E8M0 code ``c`` -> ``2**(c - 127)`` built from the bit pattern (``c = 0`` is the float32
    subnormal ``2**-127``), ``0xFF`` -> NaN."""
    if fp4_layout(layout) is NVFP4:
        return block_scales.to(torch.float32)
    c = block_scales.view(torch.uint8).to(torch.int32)
    return torch.where(c == 0xFF, float("nan"), _pow2_f32(c - 127))


def update_centers_reference(
    center: torch.Tensor,
    center_max: torch.Tensor,
    center_min: torch.Tensor,
    commit_mask: torch.Tensor,
    momentum: float,
) -> None:
    """Advance the running centers of the owners selected by ``commit_mask``, in place.

    Per selected owner and channel with a finite recorded max and min:
    ``mu = 0.5 * max + 0.5 * min`` and ``center += momentum * (mu - center)`` (float32, in
    that order; a NaN result is the canonical NaN); other channels keep their center (bits
    included). Selected owners' max/min reset to
    ``-inf``/``+inf``; unselected owners are untouched.
    """
    m = torch.tensor(momentum, dtype=torch.float32, device=center.device)
    sel = commit_mask.unsqueeze(1)
    ok = sel & torch.isfinite(center_max) & torch.isfinite(center_min)
    half = torch.tensor(0.5, dtype=torch.float32, device=center.device)
    mu = half * center_max + half * center_min
    new = canonical_nan(center + m * (mu - center))
    center.copy_(torch.where(ok, new, center))
    center_max.masked_fill_(sel, float("-inf"))
    center_min.masked_fill_(sel, float("inf"))
