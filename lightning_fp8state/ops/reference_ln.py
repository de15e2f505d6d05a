"""Pure-torch reference of the LayerNorm backward (``csrc/ln_ops.cu``), reduction order included.

The backward of the fused prologue's LayerNorm (:mod:`.reference_fused`), from its saved
``(mean, rstd)``; the kernel and this reference agree bit for bit. Every float32 operation is
one correctly rounded IEEE operation (no fused multiply-add), in this order:

- per element: ``xhat = (x - mean) * rstd``; ``g = dy * weight`` (``g = dy`` without weight);
- per row, two sums over the row in the kernel's order: ``s1 = sum(g)``, ``s2 = sum(g * xhat)``
  (the forward's order, :func:`.reference_fused._row_sum`, with ``P`` threads a row instead
  of 256: thread ``t`` sums chunks ``t, t + P, ...``, warps by XOR butterfly, warps in order);
- ``dx = ((g - s1 / N) - xhat * (s2 / N)) * rstd``, rounded to ``x``'s dtype;
- ``dgamma = sum over rows of dy * xhat``, ``dbeta = sum over rows of dy``, in two stages:
  the rows are cut into ``B`` tiles of ``R`` consecutive rows; a tile is one CTA of ``G``
  groups of ``P`` threads; group ``g`` walks rows ``g, g + G, g + 2G, ...`` of the tile and each
  thread sums its columns in that order from 0; the CTA adds its groups' sums in group order
  (the tile's partial, float32); then ``SUM_WARPS`` warps each sum partials
  ``w, w + SUM_WARPS, ...`` in order, and the warps' sums are added in warp order.

The geometry (:func:`backward_geometry`) depends on the shape and dtype only, never on the
device, so every GPU gives the same bits. Outputs: ``dx`` like ``x``; ``dgamma``, ``dbeta``
float32 of shape ``(N,)``; a NaN becomes the dtype's canonical NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .reference import canonical_nan
from .reference_fused import _chunk_width, _row_sum

__all__ = ["BWD_TILES", "SUM_WARPS", "BackwardGeometry", "backward_geometry", "layer_norm_backward_reference"]

BWD_TILES = 528  # target number of row tiles (CTAs) of the backward: 4 per SM of a 132-SM H100/H200
BWD_MAX_THREADS = 512  # threads of one CTA (all its groups together)
SUM_WARPS = 16  # warps of the second stage's CTA (one CTA per 32 columns)
_WARP = 32


class BackwardGeometry(NamedTuple):
    """How the backward kernel cuts an ``[M, N]`` problem (``csrc/ln_ops.cu`` computes the same)."""

    width: int  # V: elements in a 16-byte chunk
    rounds: int  # K: chunks a thread holds in a row
    threads: int  # P: threads sharing one row (whole warps)
    groups: int  # G: row groups in a CTA
    rows_per_tile: int  # R: consecutive rows of one CTA, a multiple of G
    tiles: int  # B: CTAs, each writing one partial row of dgamma and of dbeta


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def backward_geometry(m: int, n: int, dtype: torch.dtype) -> BackwardGeometry:
    """The backward's cut of ``m`` rows of ``n`` elements of ``dtype`` (``n`` a whole number of chunks)."""
    width = _chunk_width(dtype)
    chunks = n // width
    rounds = _ceil_div(chunks, BWD_MAX_THREADS)
    threads = _ceil_div(_ceil_div(chunks, rounds), _WARP) * _WARP
    groups = max(1, BWD_MAX_THREADS // threads)
    rows_per_tile = max(1, _ceil_div(_ceil_div(m, BWD_TILES), groups)) * groups
    tiles = _ceil_div(m, rows_per_tile)
    return BackwardGeometry(width, rounds, threads, groups, rows_per_tile, tiles)


def _tile_column_sums(c: torch.Tensor, geo: BackwardGeometry) -> torch.Tensor:
    """Stage one: ``[B, N]`` partials of ``c [M, N]`` (float32) in the CTAs' order."""
    m, n = c.shape
    per_group = geo.rows_per_tile // geo.groups
    pad = geo.tiles * geo.rows_per_tile - m
    if pad:  # rows past the end add nothing (a sum from +0.0 is never -0.0: adding +0.0 keeps it)
        c = torch.cat([c, c.new_zeros(pad, n)])
    c = c.reshape(geo.tiles, per_group, geo.groups, n)  # row = tile * R + i * G + group
    acc = c.new_zeros(geo.tiles, geo.groups, n)
    for i in range(per_group):
        acc = acc + c[:, i]
    part = acc[:, 0]
    for g in range(1, geo.groups):
        part = part + acc[:, g]
    return part


def _sum_partials(part: torch.Tensor) -> torch.Tensor:
    """Stage two: the ``[N]`` total of ``part [B, N]`` in the second kernel's order."""
    b, n = part.shape
    rounds = _ceil_div(b, SUM_WARPS)
    pad = rounds * SUM_WARPS - b
    if pad:
        part = torch.cat([part, part.new_zeros(pad, n)])
    part = part.reshape(rounds, SUM_WARPS, n)  # partial = round * SUM_WARPS + warp
    acc = part.new_zeros(SUM_WARPS, n)
    for r in range(rounds):
        acc = acc + part[r]
    total = acc[0]
    for w in range(1, SUM_WARPS):
        total = total + acc[w]
    return total


def layer_norm_backward_reference(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    output_mask: tuple[bool, bool, bool] | list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dgamma, dbeta)`` of the LayerNorm over the last dim of ``x`` (module docstring);
    an output whose ``output_mask`` entry is False is None."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    geo = backward_geometry(m, n, x.dtype)
    xf = x.detach().reshape(m, n).to(torch.float32)
    dy = grad_y.detach().reshape(m, n).to(torch.float32)
    mu = mean.detach().reshape(m, 1).to(torch.float32)
    rs = rstd.detach().reshape(m, 1).to(torch.float32)
    xhat = (xf - mu) * rs
    dx = dgamma = dbeta = None
    if output_mask[0]:
        g = dy if weight is None else dy * weight.detach().to(torch.float32)
        count = torch.full((m,), float(n), dtype=torch.float32, device=xf.device)  # tensor / tensor: a true division
        a = torch.div(_row_sum(g, geo.width, geo.threads), count)
        b = torch.div(_row_sum(g * xhat, geo.width, geo.threads), count)
        dx = ((g - a[:, None]) - xhat * b[:, None]) * rs
        dx = canonical_nan(dx.to(x.dtype)).reshape(x.shape)
    if output_mask[1]:
        dgamma = canonical_nan(_sum_partials(_tile_column_sums(dy * xhat, geo)))
    if output_mask[2]:
        dbeta = canonical_nan(_sum_partials(_tile_column_sums(dy, geo)))
    return dx, dgamma, dbeta
