"""Pure-torch reference implementations of the fp8state ops: the oracle for every kernel.

Each function follows the invariants written down in ``lightning_fp8state.formats``; the
CUDA kernels in ``csrc/`` must agree with these bit for bit.
"""

from __future__ import annotations

import torch

from ..formats import fp8_format

__all__ = [
    "amax_reference",
    "clip_count_reference",
    "column_sum_reference",
    "dequantize_fp8_reference",
    "quantize_fp8_reference",
    "transpose_fp8_reference",
    "update_scales_reference",
]


# NaN has many encodings and torch's CPU/CUDA paths disagree on its sign; every op writes
# one canonical quiet NaN so that kernels and reference agree bit for bit.
CANONICAL_NAN_FP8 = 0x7F


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN replaced by the dtype's canonical quiet NaN (``float('nan')``)."""
    return torch.where(torch.isnan(t), torch.full((), float("nan"), dtype=t.dtype, device=t.device), t)


def amax_reference(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar tensor; the canonical NaN if any element is NaN; 0 if empty."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return canonical_nan(x.detach().abs().amax().to(torch.float32))


def quantize_fp8_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Encode ``x`` as FP8: float32 multiply by ``scale``, clamp to ±max, round to nearest
    even; NaN becomes the canonical code 0x7F."""
    fmt = fp8_format(dtype)
    v = x.to(torch.float32) * scale.reshape(()).to(torch.float32)
    q = v.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    nan = torch.isnan(v)
    bits = torch.where(nan, torch.full((), CANONICAL_NAN_FP8, dtype=torch.uint8, device=q.device), q.view(torch.uint8))
    return bits.view(fmt.dtype)


def clip_count_reference(y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How many elements of ``y`` the encode clips to ±max (int64 scalar): those with
    ``|float32(y) * scale| > max``, the float32 product :func:`quantize_fp8_reference` clamps;
    an infinity counts, a NaN does not (it gets the NaN code)."""
    v = y.detach().to(torch.float32) * scale.reshape(()).to(torch.float32)
    return (v.abs() > fp8_format(dtype).max).sum()


def dequantize_fp8_reference(q: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decode FP8 ``q``: float32 multiply by ``descale``, one rounding to ``dtype``; NaN
    becomes the canonical quiet NaN of ``dtype``."""
    return canonical_nan((q.to(torch.float32) * descale.reshape(()).to(torch.float32)).to(dtype))


def update_scales_reference(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    descale: torch.Tensor,
    amax_pending: torch.Tensor,
    nonfinite_count: torch.Tensor,
    commit_mask: torch.Tensor,
    fmax: torch.Tensor,
    amax_algo: str,
    margin: int,
) -> None:
    """Advance every owner selected by ``commit_mask`` by one logical event, in place.

    For a selected owner with a finite pending amax: the history rolls (newest in row 0),
    the amax is the history's max (``max``) or its newest entry (``most_recent``), and
    ``scale = fmax / amax / 2**margin``, ``descale = 1 / scale``, unless that amax is zero
    or the scale would not be finite, in which case scale and descale stay as they were.
    A selected owner with a non-finite pending amax keeps history, scale and descale and
    has its ``nonfinite_count`` incremented. Every selected owner's pending amax is reset
    to zero. Unselected owners are untouched.
    """
    pending = amax_pending
    finite = torch.isfinite(pending)
    roll = commit_mask & finite
    shifted = torch.cat([pending.unsqueeze(0), amax_history[:-1]], dim=0)
    history = torch.where(roll.unsqueeze(0), shifted, amax_history)
    amax = history.amax(dim=0) if amax_algo == "max" else history[0]
    candidate = fmax / amax / float(2**margin)
    ok = roll & (amax > 0) & torch.isfinite(candidate)
    new_scale = torch.where(ok, candidate, scale)
    new_descale = torch.where(ok, torch.reciprocal(candidate), descale)
    amax_history.copy_(history)
    scale.copy_(new_scale)
    descale.copy_(new_descale)
    nonfinite_count.add_((commit_mask & ~finite).to(nonfinite_count.dtype))
    amax_pending.masked_fill_(commit_mask, 0.0)


def transpose_fp8_reference(q: torch.Tensor) -> torch.Tensor:
    """``q[R, C]`` re-laid out as a contiguous ``[C, R]``: the codes move, none is decoded."""
    return q.t().contiguous()


# The tile of the CUDA quantize + transpose kernel (csrc/fp8_ops.cu, quantize_t_kernel): 128 x 128
# elements for a block of 256 threads, each loading 16 bytes at a time.
T_TILE = 128
T_THREADS = 256


def column_sum_reference(x: torch.Tensor) -> torch.Tensor:
    """float32 column sums of ``x [R, C]`` in the CUDA kernel's order, from +0.0 at every step.

    Rows are taken in tiles of 128 (rows past ``R`` count as +0.0). In a tile, with
    ``rpp = 256 / (128 / (16 / element_size))`` rows per pass (16 for 16-bit ``x``, 8 for
    float32): the rows ``i, i + rpp, i + 2 rpp, ..`` are summed in that order for each
    ``i < rpp``; those ``rpp`` partials are summed in order of ``i``; the tiles' sums are
    summed in order of the tile. A NaN result is the canonical NaN.
    """
    rows, cols = x.shape
    rpp = T_THREADS // (T_TILE // (16 // x.element_size()))
    tiles = -(-rows // T_TILE)
    v = torch.zeros(tiles * T_TILE, cols, dtype=torch.float32, device=x.device)
    v[:rows] = x.detach().to(torch.float32)
    v = v.view(tiles, T_TILE // rpp, rpp, cols)
    part = torch.zeros(tiles, rpp, cols, dtype=torch.float32, device=x.device)
    for j in range(T_TILE // rpp):
        part = part + v[:, j]
    tile_sums = torch.zeros(tiles, cols, dtype=torch.float32, device=x.device)
    for i in range(rpp):
        tile_sums = tile_sums + part[:, i]
    total = torch.zeros(cols, dtype=torch.float32, device=x.device)
    for t in range(tiles):
        total = total + tile_sums[t]
    return canonical_nan(total)
