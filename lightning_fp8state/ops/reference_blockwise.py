"""Pure-torch references of block-scaled FP8 (``fp8_blockwise``): one scale per 1x128 tile of an
activation or gradient, per 128x128 block of a weight, each from that tile's own amax. The
oracle of their kernels, and the CPU implementation of their ops (:mod:`.library_blockwise`).

Numerics, per tile (every tile alike, reference and kernel):

* **Tiles.** A 2-D ``x [R, C]`` is cut into tiles of ``rows x cols`` elements starting at
  ``(0, 0)``: ``1 x 128`` (:func:`quantize_fp8_tile_reference`) or ``128 x 128``
  (:func:`quantize_fp8_block_reference`). Scales are float32 ``[ceil(R / rows), ceil(C /
  cols)]``, row-major, tile ``(i, j)`` at ``[i, j]``. A tile cut by the edge (``C`` or ``R`` not
  a multiple of the tile) is a *partial tile*: it takes the amax of its own elements only
  (nothing is padded into the codes, which keep ``x``'s shape; a padding of zeros would give
  the same amax, which is why a kernel may pad its loads with zeros).
* **Amax** of a tile: ``max |x|`` in float32 (exact: the float32 value of a bf16/fp16 element
  is exact), NaN-propagating: a tile holding a NaN has the canonical NaN amax.
* **Scale** of a tile: fp8_current's formula and guards on that amax
  (:func:`.reference_dynamic.dynamic_scale_reference`): ``fmax / amax / 2**margin`` and its
  reciprocal as descale; a tile whose amax is zero (an all-zero tile), NaN or infinite, or whose
  scale would not be finite, gets ``scale = descale = 1``, as a whole fp8_current tensor would.
* **Power-of-two scales** (``pow2``): that scale rounded *down* to a power of two by clearing
  its float32 mantissa bits (a subnormal scale keeps its highest set bit; ``1`` stays ``1``),
  so an ``amax * scale`` never exceeds what the unrounded scale gives; ``descale = 1 / scale``,
  exact for a power of two. The flooring acts on the float32 scale above (after its two
  divisions' roundings), not on the real quotient.
* **Codes**: the FP8 encoding of :mod:`lightning_fp8state.formats` with each element's tile
  scale: ``float32(x) * scale`` (one IEEE multiply), clamped to ``±fmax`` (an infinity
  saturates; its tile's scale is 1), rounded to nearest even; NaN becomes the canonical code
  ``0x7F``. So a tile holding an infinity or a NaN is encoded exactly as fp8_current would
  encode a tensor holding one, and other tiles keep their own scales.
* **The transpose** of a 128x128-block encode (the weight's operand in the input gradient) is
  the same blocks transposed: tile ``(i, j)`` of ``x`` is tile ``(j, i)`` of ``x^T``, with the
  same elements, amax and scale. So the transpose's codes are the codes transposed (bitwise) and
  its scales the scales transposed; one read of the weight gives both.
* **Column tiles** (:func:`quantize_fp8_tile_t_reference`): ``x``'s ``128 x 1`` tiles, i.e. the
  1x128 tiles of ``x^T``, with the codes written transposed (``[C, R]``, contiguous): the weight
  gradient's operands, scaled along the tokens it sums over.
"""

from __future__ import annotations

import torch

from ..formats import fp8_format
from .reference import canonical_nan
from .reference_dynamic import dynamic_scale_reference, quantize_fp8_scaled_reference

__all__ = [
    "BLOCK",
    "blockwise_scale_reference",
    "floor_pow2_reference",
    "quantize_fp8_block_reference",
    "quantize_fp8_tile_reference",
    "quantize_fp8_tile_t_reference",
    "tile_amax_reference",
]

# the tile edge: 1 x BLOCK tiles of activations and gradients, BLOCK x BLOCK blocks of a weight
BLOCK = 128

_EXPONENT_BITS = 0x7F800000


def tile_amax_reference(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``max |x|`` of each ``rows x cols`` tile of the 2-D ``x`` (partial tiles at the edges take
    their own elements): float32 ``[ceil(R / rows), ceil(C / cols)]``, the canonical NaN where a
    tile holds a NaN."""
    r, c = x.shape
    n_r, n_c = -(-r // rows), -(-c // cols)
    a = x.detach().abs().to(torch.float32)
    padded = a.new_zeros(n_r * rows, n_c * cols)  # zeros: |x| >= 0 leaves every amax as it is
    padded[:r, :c] = a
    return canonical_nan(padded.reshape(n_r, rows, n_c, cols).amax(dim=(1, 3)))


def floor_pow2_reference(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two ``<=`` each positive float32 ``scale`` (bit operations, exact):
    a normal number's mantissa bits cleared; a subnormal one's highest set bit kept; ``+0``
    stays ``+0``."""
    bits = scale.contiguous().view(torch.int32)
    normal = bits & _EXPONENT_BITS
    # a subnormal's bits are its value in units of 2**-149: as a float32 integer (exact, < 2**23)
    # its exponent field says where its highest set bit is
    top = ((bits.to(torch.float32).view(torch.int32) >> 23) - 127).clamp(min=0)
    subnormal = torch.bitwise_left_shift(torch.ones_like(bits), top)
    out = torch.where(normal != 0, normal, torch.where(bits > 0, subnormal, bits))
    return out.view(torch.float32)


def blockwise_scale_reference(amax: torch.Tensor, fmax: float, margin: int, pow2: bool):
    """``(scale, descale)`` of each tile's ``amax`` (see the module doc): fp8_current's
    formula and guards, then with ``pow2`` the scale floored to a power of two."""
    scale, descale = dynamic_scale_reference(amax, fmax, margin)
    if pow2:
        scale = floor_pow2_reference(scale)
        descale = torch.reciprocal(scale)
    return scale, descale


def _tiled(x: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, margin: int, pow2: bool):
    """``(codes, scale, descale, amax)`` of ``x [R, C]`` in ``rows x cols`` tiles."""
    amax = tile_amax_reference(x, rows, cols)
    scale, descale = blockwise_scale_reference(amax, fp8_format(dtype).max, margin, pow2)
    r, c = x.shape
    per_element = scale.repeat_interleave(rows, dim=0)[:r].repeat_interleave(cols, dim=1)[:, :c]
    return quantize_fp8_scaled_reference(x, per_element, dtype).contiguous(), scale, descale, amax


def quantize_fp8_tile_reference(x: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool):
    """``x [R, C]`` in 1x128 tiles: ``(codes [R, C], scale, descale, amax)``, the last three
    float32 ``[R, ceil(C / 128)]``."""
    return _tiled(x, 1, BLOCK, dtype, margin, pow2)


def quantize_fp8_tile_t_reference(x: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool):
    """``x [R, C]`` in 128x1 tiles, written transposed: :func:`quantize_fp8_tile_reference` of
    ``x^T``, i.e. ``(codes [C, R] contiguous, scale, descale, amax)``, the last three float32
    ``[C, ceil(R / 128)]``."""
    return _tiled(x.t(), 1, BLOCK, dtype, margin, pow2)


def quantize_fp8_block_reference(x: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool):
    """A weight ``x [R, C]`` in 128x128 blocks, with its transpose's encode: ``(codes [R, C],
    scale, descale, amax, codes_t [C, R], descale_t)``; ``scale``, ``descale`` and ``amax``
    float32 ``[ceil(R / 128), ceil(C / 128)]``, ``codes_t`` and ``descale_t`` (float32
    ``[ceil(C / 128), ceil(R / 128)]``) contiguous and bitwise the blocks of ``x^T`` (the
    module doc)."""
    q, scale, descale, amax = _tiled(x, BLOCK, BLOCK, dtype, margin, pow2)
    return q, scale, descale, amax, q.t().contiguous(), descale.t().contiguous()


def quantize_fp8_tile_pair_reference(x: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool):
    """A gradient ``x [R, C]`` in both tilings its GEMMs read: ``(codes [R, C], scale, descale,
    amax)`` of :func:`quantize_fp8_tile_reference` and ``(codes_t [C, R], descale_t [C,
    ceil(R / 128)])`` of :func:`quantize_fp8_tile_t_reference`."""
    q_t, _, descale_t, _ = quantize_fp8_tile_t_reference(x, dtype, margin, pow2)
    return (*quantize_fp8_tile_reference(x, dtype, margin, pow2), q_t, descale_t)
