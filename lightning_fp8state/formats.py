"""Low-precision number formats and the invariants every op and kernel keeps.

FP8 invariants (both formats, reference and CUDA alike):

* Encoding computes ``v = float32(x) * scale`` in float32 (one IEEE multiply, round to
  nearest even), clamps ``v`` to ``[-max, +max]`` and casts with round-to-nearest-even.
  Clamping first means every finite or infinite input saturates to ``±max``; torch 2.11
  would turn out-of-range values into NaN and 2.13 saturates, so we never rely on the cast.
* NaN stays NaN and is written as the canonical code ``0x7F`` (positive sign) in both
  formats; a decoded NaN is the output dtype's canonical quiet NaN (``float('nan')``), and a
  recorded amax of a tensor holding NaN is the canonical float32 NaN ``0x7FC00000``.
  (E4M3 has no infinity; E5M2's infinities are never produced.)
* Subnormals are kept: the smallest positive E4M3 value is ``2**-9``, E5M2's ``2**-16``.
* Decoding computes ``float32(q) * descale`` in float32 and rounds once to the output dtype.
* ``descale == 1 / scale`` (IEEE division in float32), frozen together in one snapshot.

FP4 invariants (packed E2M1 with block scales; reference and CUDA alike):

* **E2M1 codes.** 4 bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0). The
  16 codes decode to ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (code ``c`` and ``c | 8`` differ only
  in sign; ``0x8`` is ``-0``). No infinity, no NaN.
* **E2M1 rounding** of a float32 ``y``: round to the nearest value, ties to the even code
  (so ``0.25 -> 0``, ``0.75 -> 1``, ``1.25 -> 1``, ``1.75 -> 2``, ``2.5 -> 2``,
  ``3.5 -> 4``, ``5 -> 4``); ``|y| > 5`` (including infinity) saturates to ``±6``; the sign
  bit is ``y``'s sign bit (``-0.1 -> -0``); NaN encodes as code ``0`` (its block scale is NaN,
  see below, so the block still decodes to NaN).
* **Packing.** Codes are stored two per byte along the last dimension: element ``2i`` in the
  low nibble, element ``2i + 1`` in the high nibble; ``uint8`` storage of shape
  ``[..., K / 2]``. ``K`` (the last dimension) must be a multiple of the layout's block size,
  hence even.
* **Blocks.** Blocks are ``block_size`` consecutive elements of the last dimension (a row
  ``[..., K]`` has ``K / block_size`` blocks). Block scales are stored row-major, shape
  ``[..., K / block_size]`` (no swizzle: a GEMM kernel that wants cuBLAS's tiled scale layout
  rearranges them itself).
* **Tensor scale.** Both layouts also take one FP32 tensor-level scale ``S`` (encode) and its
  paired descale ``D = 1 / S`` (decode). ``S`` is the *delayed, owned* state: it comes from the
  owner's amax history like an FP8 scale, ``S = fmax / amax / 2**margin``, with
  ``fmax = 6 * 448 = 2688`` for NVFP4 (the historical amax lands on the largest E4M3 block
  scale times the largest E2M1 value) and ``fmax = 6`` for MXFP4 (the historical amax lands
  on E2M1's 6 with block exponent 0). Block scales are *not* state: each call derives them
  from its own data.
* **NVFP4** (16-element blocks, E4M3 block scale ``sb``). For a block with
  ``a = max|x|`` (float32, NaN-propagating): ``v = float32(float32(a / 6) * S)`` (``a / 6`` an
  IEEE division, not a product with a rounded 1/6); for ``v > 0``, ``sb = E4M3(min(v, 448))``
  (round to nearest even, as the FP8 cast, so ``v`` above 448 and ``+inf`` give 448);
  ``v <= 0`` (also ``-0``, from a zero or negative ``S``) gives ``sb = +0`` (code ``0x00``);
  ``v`` NaN gives the NaN code ``0x7F``. ``enc = float32(S / float32(sb))``, or ``0`` when
  ``sb == 0``; every element encodes as ``E2M1(float32(float32(x) * enc))`` (``inf * 0`` is
  NaN, so code 0). Decoding is ``float32(float32(e * sb) * D)`` (``e * sb`` is exact) rounded
  once to the output dtype.
* **MXFP4** (32-element blocks, E8M0 block scale ``2**X``; OCP MX v1.0 with a tensor scale in
  front). ``u = float32(float32(x) * S)``; ``A = max|u|`` over the block (equal to
  ``float32(a * |S|)`` for a finite ``S``: rounding is monotonic; an infinite ``S`` makes
  ``0 * S`` NaN); ``X = floor(log2(A)) - 2`` (2 = E2M1's largest exponent, as the OCP spec),
  read off ``A``'s float32 exponent field and clamped to ``[-127, 127]`` (so every ``A`` below
  ``2**-124``, float32 subnormals included, gives ``-127``); ``A == 0`` gives ``X = -127``,
  ``A == inf`` gives ``X = 127``, ``A`` NaN gives the E8M0 NaN code ``0xFF``. The E8M0 code is
  ``X + 127``; it decodes to ``2**(code - 127)`` (code 0: the float32 subnormal ``2**-127``)
  and ``0xFF`` to NaN. Elements encode as ``E2M1(u * 2**-X)`` (the power-of-two multiply is exact
  wherever the result can round to a nonzero code). Like the OCP spec, values in
  ``(6, 8) * 2**X`` saturate to 6. Decoding is ``float32(float32(e * 2**X) * D)``, one
  rounding to the output dtype.
* **NaN.** A NaN anywhere in a block makes its amax NaN, hence its block scale NaN (E4M3
  ``0x7F`` / E8M0 ``0xFF``), and the whole block decodes to NaN; the recorded tensor amax is
  NaN too (the owner's next commit skips it and counts it, as for FP8). Kernels must use a
  NaN-propagating max (not ``fmaxf``). Every NaN an op writes is canonical: the recorded
  amax is ``0x7FC00000``, a decoded NaN is the output dtype's ``float('nan')`` (``0x7FC00000``,
  bf16 ``0x7FC0``, fp16 ``0x7E00``), and so are NaN center statistics and NaN centers.
* **Float32 arithmetic.** Every float32 step above is one IEEE operation rounding to nearest
  even, subnormals included (no flush to zero) and never fused: ``0.5 * max + 0.5 * min``,
  ``c + m * (mu - c)`` and decoding's ``d * D + c`` round after each operation.
* **The pending amax** folds with a NaN-propagating max; kernels do it with an integer
  ``atomicMax`` on the float bits, which is that max for everything the ops write there
  (non-negative floats and the canonical NaN, which orders above ``+inf``).
* **Centered variant.** With a center ``c`` (float32, one value per element of the last
  dimension), encoding quantizes ``xc = float32(float32(x) - c)`` exactly as above (and the
  recorded amax is ``max|xc|``); decoding adds it back: ``float32(decoded + c)`` before the
  rounding to the output dtype. The center is *owned, delayed state* like the scale: a call
  records per-channel ``max`` and ``min`` of ``x`` (over all leading dimensions, folded into
  the owner's earlier observations; ``-0 < +0``, the order of the sign-magnitude bit patterns
  as integers, and a channel holding a NaN, now or before, gets the canonical NaN); at the
  owner's commit, ``mu = float32(0.5 * max + 0.5 * min)`` (the midrange: it minimises
  ``max|x - c|``, and unlike a mean it does not depend on reduction order, so every kernel
  agrees bit for bit) and ``c <- float32(c + float32(m * float32(mu - c)))`` with the momentum
  ``m``; a channel whose max or min is not finite (unobserved, NaN, inf) keeps its center.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3",
    "E5M2",
    "FP4_LAYOUTS",
    "FP8_FORMATS",
    "BLOCK_128X128",
    "MXFP4",
    "NVFP4",
    "PER_COLUMN",
    "PER_ROW",
    "PER_TENSOR",
    "SCALE_LAYOUTS",
    "STATE_FORMATS",
    "Fp4Layout",
    "Fp8Format",
    "ScaleLayout",
    "TILE_1X128",
    "fp4_layout",
    "fp8_format",
    "state_format_fmax",
    "state_format_name",
]


@dataclass(frozen=True)
class Fp8Format:
    """An 8-bit floating-point format as torch stores it."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # largest finite magnitude; encoding saturates here
    min_normal: float  # 2 ** (1 - bias)
    min_subnormal: float  # 2 ** (1 - bias - mantissa_bits)
    has_inf: bool


E4M3 = Fp8Format(
    name="e4m3",
    dtype=torch.float8_e4m3fn,
    exponent_bits=4,
    mantissa_bits=3,
    bias=7,
    max=448.0,
    min_normal=2.0**-6,
    min_subnormal=2.0**-9,
    has_inf=False,
)
E5M2 = Fp8Format(
    name="e5m2",
    dtype=torch.float8_e5m2,
    exponent_bits=5,
    mantissa_bits=2,
    bias=15,
    max=57344.0,
    min_normal=2.0**-14,
    min_subnormal=2.0**-16,
    has_inf=True,
)

FP8_FORMATS: dict[str, Fp8Format] = {f.name: f for f in (E4M3, E5M2)}
_BY_DTYPE: dict[torch.dtype, Fp8Format] = {f.dtype: f for f in (E4M3, E5M2)}


def fp8_format(spec: str | torch.dtype | Fp8Format) -> Fp8Format:
    """Return the format named by ``spec`` (``"e4m3"``, ``"e5m2"`` or a float8 dtype).

    Raises:
        ConfigError: ``spec`` names no FP8 format.
    """
    if isinstance(spec, Fp8Format):
        return spec
    if isinstance(spec, torch.dtype):
        if spec in _BY_DTYPE:
            return _BY_DTYPE[spec]
    elif spec in FP8_FORMATS:
        return FP8_FORMATS[spec]
    raise ConfigError(
        f"unknown FP8 format {spec!r}: expected one of {sorted(FP8_FORMATS)} or {[str(d) for d in _BY_DTYPE]}"
    )


# -- FP4 ----------------------------------------------------------------------------------

# Non-negative E2M1 values by code 0..7; code c | 8 is the negative of code c.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


@dataclass(frozen=True)
class Fp4Layout:
    """A packed-FP4 block layout: E2M1 elements, one block scale per ``block_size`` elements
    of the last dimension, and one FP32 tensor scale (the delayed state)."""

    name: str
    block_size: int
    block_scale: str  # "e4m3" | "e8m0"
    block_scale_dtype: torch.dtype
    tensor_fmax: float  # fmax of the tensor-level delayed scale: S = tensor_fmax / amax


NVFP4 = Fp4Layout("nvfp4", 16, "e4m3", torch.float8_e4m3fn, E2M1_MAX * E4M3.max)
MXFP4 = Fp4Layout("mxfp4", 32, "e8m0", torch.float8_e8m0fnu, E2M1_MAX)
FP4_LAYOUTS: dict[str, Fp4Layout] = {f.name: f for f in (NVFP4, MXFP4)}

# Every format a state-bank owner can have, by name (saved in checkpoints).
STATE_FORMATS = (*FP8_FORMATS, *FP4_LAYOUTS)


def fp4_layout(spec: str | Fp4Layout) -> Fp4Layout:
    """Return the FP4 layout named by ``spec`` (``"nvfp4"`` or ``"mxfp4"``).

    Raises:
        ConfigError: ``spec`` names no FP4 layout.
    """
    if isinstance(spec, Fp4Layout):
        return spec
    if spec in FP4_LAYOUTS:
        return FP4_LAYOUTS[spec]
    raise ConfigError(f"unknown FP4 layout {spec!r}: expected one of {sorted(FP4_LAYOUTS)}")


def state_format_name(spec: str | torch.dtype | Fp8Format | Fp4Layout) -> str:
    """The name of an owner's format: an FP8 format (or float8 dtype) or an FP4 layout."""
    if isinstance(spec, Fp4Layout) or (isinstance(spec, str) and spec in FP4_LAYOUTS):
        return fp4_layout(spec).name
    return fp8_format(spec).name


def state_format_fmax(spec: str | torch.dtype | Fp8Format | Fp4Layout) -> float:
    """The ``fmax`` of an owner's delayed scale (``scale = fmax / amax / 2**margin``)."""
    name = state_format_name(spec)
    if name in FP4_LAYOUTS:
        return FP4_LAYOUTS[name].tensor_fmax
    return FP8_FORMATS[name].max


# -- scale layouts: which elements of an FP8 operand share one scale --------------------------


@dataclass(frozen=True)
class ScaleLayout:
    """How one FP8 operand's scales cover its 2-D data ``[R, C]`` (as the role stores it: an
    input ``[tokens, in]``, a weight ``[out, in]``, a grad_output ``[tokens, out]``): every tile
    of ``rows x cols`` elements shares one scale, ``0`` meaning the whole dimension. Per tensor
    is ``0 x 0``, per row ``1 x 0`` (a weight's rows are its output channels), per column
    ``0 x 1``, a 1x128 tile ``1 x 128``, a 128x128 block ``128 x 128``. Its scales are a
    float32 ``scale_shape(shape)`` tensor (a tile cut by the edge still has one), a 0-d or
    one-element tensor per tensor. Recipes declare one per role and GEMM operand
    (:mod:`lightning_fp8state.quant_recipes`); consumers read the layout, never assume one."""

    name: str
    rows: int = 0
    cols: int = 0

    @property
    def per_tensor(self) -> bool:
        return self.rows == 0 and self.cols == 0

    def scale_shape(self, shape) -> tuple[int, int]:
        """The shape of the scales of data shaped ``shape`` (its last two dims; a 1-D tensor is one row)."""
        r, c = (1, shape[-1]) if len(shape) < 2 else (shape[-2], shape[-1])
        return (1 if self.rows == 0 else -(-r // self.rows), 1 if self.cols == 0 else -(-c // self.cols))

    def expand(self, scales: torch.Tensor, shape) -> torch.Tensor:
        """``scales`` as one value per element of data shaped ``shape`` (broadcastable to it):
        how a decode pairs each code with its descale."""
        if self.per_tensor:
            return scales.reshape(())
        grid = scales.reshape(self.scale_shape(shape))
        r, c = (1, shape[-1]) if len(shape) < 2 else (shape[-2], shape[-1])
        if self.rows > 1:
            grid = grid.repeat_interleave(self.rows, dim=0)[:r]
        if self.cols > 1:
            grid = grid.repeat_interleave(self.cols, dim=1)[:, :c]
        return grid if len(shape) >= 2 else grid.reshape(-1)

    def holds(self, scales: torch.Tensor, shape) -> bool:
        """Whether ``scales`` has this layout's size for data shaped ``shape``."""
        r, c = self.scale_shape(shape)
        return scales.numel() == r * c


PER_TENSOR = ScaleLayout("tensor")
PER_ROW = ScaleLayout("row", 1, 0)
PER_COLUMN = ScaleLayout("column", 0, 1)
TILE_1X128 = ScaleLayout("1x128", 1, 128)
BLOCK_128X128 = ScaleLayout("128x128", 128, 128)
SCALE_LAYOUTS = {layout.name: layout for layout in (PER_TENSOR, PER_ROW, PER_COLUMN, TILE_1X128, BLOCK_128X128)}
