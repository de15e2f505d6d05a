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

FP4 formats (E2M1 with block scales) are added on the same protocol in a later module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError

__all__ = ["E4M3", "E5M2", "FP8_FORMATS", "Fp8Format", "fp8_format"]


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
