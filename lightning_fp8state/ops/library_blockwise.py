"""The ``fp8state`` ops of block-scaled FP8 (``fp8_blockwise``): schemas, input checks, reference
and fake kernels (numerics: :mod:`.reference_blockwise`).

Each returns the codes with the per-tile scale, descale and amax it derived from its input, so
the caller pairs them in the call's snapshot. The reference (``CompositeExplicitAutograd``)
serves every device until a CUDA kernel registers for the op under
``TORCH_LIBRARY_IMPL(fp8state, CUDA, m)`` (``csrc/blockwise_ops.cu``); the recipe calls these
wrappers only, so a kernel changes no line of it. A kernel must be bitwise the reference
(``tests/ops/test_cuda_blockwise.py``).
"""

from __future__ import annotations

import torch

from ..config import MARGIN_MAX, require_that
from . import cuda
from . import reference_blockwise as ref
from .library import _FP8_DTYPES, _IN_DTYPES, LIB

__all__ = ["quantize_fp8_block", "quantize_fp8_tile", "quantize_fp8_tile_pair", "quantize_fp8_tile_t"]

LIB.define("quantize_fp8_tile(Tensor x, ScalarType dtype, int margin, bool pow2) -> (Tensor, Tensor, Tensor, Tensor)")
LIB.define("quantize_fp8_tile_t(Tensor x, ScalarType dtype, int margin, bool pow2) -> (Tensor, Tensor, Tensor, Tensor)")
LIB.define(
    "quantize_fp8_block(Tensor x, ScalarType dtype, int margin, bool pow2) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
LIB.define(
    "quantize_fp8_tile_pair(Tensor x, ScalarType dtype, int margin, bool pow2) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _check(x: torch.Tensor, dtype: torch.dtype, margin: int) -> None:
    require_that(x.dtype in _IN_DTYPES, "x.dtype", x.dtype, f"one of {list(_IN_DTYPES)}")
    require_that(dtype in _FP8_DTYPES, "dtype", dtype, f"one of {list(_FP8_DTYPES)}")
    require_that(0 <= margin <= MARGIN_MAX, "margin", margin, f"an integer >= 0 and <= {MARGIN_MAX}")
    require_that(x.dim() == 2, "x.dim()", x.dim(), "2")


# CUDA: csrc/blockwise_ops.cu (one pass: each warp a tile's amax, then its codes from registers)
@torch.library.impl(LIB, "quantize_fp8_tile", "CompositeExplicitAutograd")
def _quantize_fp8_tile(x: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool):
    _check(x, dtype, margin)
    return ref.quantize_fp8_tile_reference(x, dtype, margin, pow2)


# CUDA: csrc/blockwise_ops.cu (128 x 128 tiles through shared memory, written transposed)
@torch.library.impl(LIB, "quantize_fp8_tile_t", "CompositeExplicitAutograd")
def _quantize_fp8_tile_t(x: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool):
    _check(x, dtype, margin)
    return ref.quantize_fp8_tile_t_reference(x, dtype, margin, pow2)


# CUDA: csrc/blockwise_ops.cu (one block per 128 x 128 tile: its amax, then both layouts)
@torch.library.impl(LIB, "quantize_fp8_block", "CompositeExplicitAutograd")
def _quantize_fp8_block(x: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool):
    _check(x, dtype, margin)
    return ref.quantize_fp8_block_reference(x, dtype, margin, pow2)


# CUDA: csrc/blockwise_ops.cu (whole 128 x 128 tiles: one read gives both tilings; else the two kernels)
@torch.library.impl(LIB, "quantize_fp8_tile_pair", "CompositeExplicitAutograd")
def _quantize_fp8_tile_pair(x: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool):
    _check(x, dtype, margin)
    return ref.quantize_fp8_tile_pair_reference(x, dtype, margin, pow2)


def _tiles(n: int) -> int:
    return -(-n // ref.BLOCK)


def _scales_fake(x: torch.Tensor, shape: tuple[int, int]):
    s = x.new_empty(shape, dtype=torch.float32)
    return s, torch.empty_like(s), torch.empty_like(s)


@torch.library.register_fake("fp8state::quantize_fp8_tile")
def _quantize_fp8_tile_fake(x, dtype, margin, pow2):
    q = x.new_empty(x.shape, dtype=dtype)
    return (q, *_scales_fake(x, (x.shape[0], _tiles(x.shape[1]))))


@torch.library.register_fake("fp8state::quantize_fp8_tile_t")
def _quantize_fp8_tile_t_fake(x, dtype, margin, pow2):
    q = x.new_empty((x.shape[1], x.shape[0]), dtype=dtype)
    return (q, *_scales_fake(x, (x.shape[1], _tiles(x.shape[0]))))


@torch.library.register_fake("fp8state::quantize_fp8_block")
def _quantize_fp8_block_fake(x, dtype, margin, pow2):
    r, c = x.shape
    q = x.new_empty((r, c), dtype=dtype)
    q_t = x.new_empty((c, r), dtype=dtype)
    descale_t = x.new_empty((_tiles(c), _tiles(r)), dtype=torch.float32)
    return (q, *_scales_fake(x, (_tiles(r), _tiles(c))), q_t, descale_t)


@torch.library.register_fake("fp8state::quantize_fp8_tile_pair")
def _quantize_fp8_tile_pair_fake(x, dtype, margin, pow2):
    r, c = x.shape
    q_t = x.new_empty((c, r), dtype=dtype)
    return (*_quantize_fp8_tile_fake(x, dtype, margin, pow2), q_t, x.new_empty((c, _tiles(r)), dtype=torch.float32))


def quantize_fp8_tile(x: torch.Tensor, dtype: torch.dtype, margin: int = 0, pow2: bool = False):
    """``x [R, C]`` in 1x128 tiles: ``(codes [R, C], scale, descale, amax)``, each of the last
    three float32 ``[R, ceil(C / 128)]`` (:func:`.reference_blockwise.quantize_fp8_tile_reference`)."""
    cuda.load_for(x)
    return torch.ops.fp8state.quantize_fp8_tile(x, dtype, margin, pow2)


def quantize_fp8_tile_t(x: torch.Tensor, dtype: torch.dtype, margin: int = 0, pow2: bool = False):
    """``x [R, C]`` in 128x1 tiles, codes transposed: ``(codes [C, R], scale, descale, amax)``,
    the last three ``[C, ceil(R / 128)]``; bitwise ``quantize_fp8_tile(x.t().contiguous())``."""
    cuda.load_for(x)
    return torch.ops.fp8state.quantize_fp8_tile_t(x, dtype, margin, pow2)


def quantize_fp8_block(x: torch.Tensor, dtype: torch.dtype, margin: int = 0, pow2: bool = False):
    """A weight ``x [R, C]`` in 128x128 blocks and its transpose's encode: ``(codes, scale,
    descale, amax, codes_t [C, R], descale_t)``
    (:func:`.reference_blockwise.quantize_fp8_block_reference`)."""
    cuda.load_for(x)
    return torch.ops.fp8state.quantize_fp8_block(x, dtype, margin, pow2)


def quantize_fp8_tile_pair(x: torch.Tensor, dtype: torch.dtype, margin: int = 0, pow2: bool = False):
    """A gradient ``x [R, C]`` in 1x128 tiles and in 128x1 tiles written transposed, from one read
    where the kernel can: ``(codes, scale, descale, amax, codes_t [C, R], descale_t [C, ceil(R /
    128)])``, bitwise :func:`quantize_fp8_tile` and :func:`quantize_fp8_tile_t`'s codes and descale."""
    cuda.load_for(x)
    return torch.ops.fp8state.quantize_fp8_tile_pair(x, dtype, margin, pow2)
