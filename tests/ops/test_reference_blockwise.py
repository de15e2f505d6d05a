"""The block-scaled FP8 ops (``fp8_blockwise``) on the CPU against a straightforward formulation
written here: a loop over the tiles, each tile's amax, its scale and its codes on their own.
Bitwise, on fresh random data with a different magnitude in every tile; partial tiles at the
edges, power-of-two scales, an all-zero tile, saturation and non-finite tiles."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fp8state.errors import ConfigError
from lightning_fp8state.ops.library_blockwise import quantize_fp8_block, quantize_fp8_tile, quantize_fp8_tile_t
from tests.conftest import bitwise_equal

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def tile_scale(amax: float, fmax: float, margin: int, pow2: bool) -> float:
    """One tile's scale: fp8_current's formula (float32 divisions) and guard, floored to a power of
    two with ``pow2``."""
    if not math.isfinite(amax) or amax == 0:
        return 1.0
    s = (torch.tensor(fmax, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)) / float(2**margin)
    s = s.item()
    if not math.isfinite(s):
        return 1.0
    if pow2:
        mantissa, exponent = math.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
        s = math.ldexp(1.0, exponent - 1)
    return s


def encode_tile(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    v = t.to(torch.float32) * torch.tensor(scale, dtype=torch.float32)
    q = v.clamp(-FMAX[dtype], FMAX[dtype]).to(dtype).view(torch.uint8)
    return torch.where(torch.isnan(v), torch.tensor(0x7F, dtype=torch.uint8), q).view(dtype)


def tiled_by_loop(x: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, margin: int, pow2: bool):
    """``(codes, scale, descale, amax)`` of ``x`` in ``rows x cols`` tiles, one tile at a time."""
    r, c = x.shape
    n_r, n_c = -(-r // rows), -(-c // cols)
    codes = torch.empty((r, c), dtype=dtype)
    scale = torch.empty((n_r, n_c), dtype=torch.float32)
    amax = torch.empty_like(scale)
    for i in range(n_r):
        for j in range(n_c):
            tile = x[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].to(torch.float32)
            a = float("nan") if tile.isnan().any() else tile.abs().max().item()
            amax[i, j] = a
            scale[i, j] = tile_scale(a, FMAX[dtype], margin, pow2)
            codes[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = encode_tile(tile, scale[i, j].item(), dtype)
    return codes, scale, 1.0 / scale, amax


def fresh(rows: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random data, never zero, its magnitude varying over 2**-12 .. 2**12 in steps of 32 columns
    and 40 rows (so tiles of one row and blocks of 128 alike see different amaxes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) + 0.01
    col = torch.randint(-12, 13, (-(-cols // 32),), generator=g).repeat_interleave(32)[:cols]
    row = torch.randint(-4, 5, (-(-rows // 40),), generator=g).repeat_interleave(40)[:rows]
    return (x * torch.exp2((col[None, :] + row[:, None]).float())).to(dtype)


def check(got, want) -> None:
    q, scale, descale, amax = got
    wq, wscale, wdescale, wamax = want
    assert bitwise_equal(q, wq)
    assert bitwise_equal(scale, wscale) and bitwise_equal(descale, wdescale)
    assert bitwise_equal(amax, wamax)


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize(("fmt", "margin"), [(E4M3, 0), (E5M2, 1)], ids=["e4m3", "e5m2-margin1"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_tile_quantize_is_the_loop_over_1x128_tiles(in_dtype, fmt, margin, pow2):
    x = fresh(9, 300, seed=1, dtype=in_dtype)  # 300 = 128 + 128 + a partial tile of 44
    got = quantize_fp8_tile(x, fmt, margin, pow2)
    assert got[1].shape == (9, 3)
    check(got, tiled_by_loop(x, 1, 128, fmt, margin, pow2))


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_column_tiles_are_the_tiles_of_the_transpose_written_transposed(pow2):
    x = fresh(300, 70, seed=2, dtype=torch.bfloat16)
    got = quantize_fp8_tile_t(x, E4M3, 0, pow2)
    assert got[0].shape == (70, 300) and got[0].is_contiguous() and got[1].shape == (70, 3)
    check(got, tiled_by_loop(x.t(), 1, 128, E4M3, 0, pow2))


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_block_quantize_is_the_loop_over_128x128_blocks_and_gives_the_transposes_blocks(pow2):
    x = fresh(200, 300, seed=3)  # 2 x 3 blocks, partial along both edges
    q, scale, descale, amax, q_t, descale_t = quantize_fp8_block(x, E4M3, 0, pow2)
    assert scale.shape == (2, 3)
    check((q, scale, descale, amax), tiled_by_loop(x, 128, 128, E4M3, 0, pow2))
    # the transpose, quantized in its own 128x128 blocks from scratch
    tq, _, tdescale, _ = tiled_by_loop(x.t().contiguous(), 128, 128, E4M3, 0, pow2)
    assert q_t.is_contiguous() and bitwise_equal(q_t, tq) and bitwise_equal(descale_t, tdescale)


def test_a_partial_tile_takes_its_own_amax():
    x = fresh(4, 130, seed=4)
    x[:, 128:] = torch.tensor([[1e-3, -2e-3]] * 4)  # the edge tile: 2 small elements
    _, scale, _, amax = quantize_fp8_tile(x, E4M3, 0)
    assert torch.equal(amax[:, 1], torch.full((4,), 2e-3))
    assert torch.equal(scale[:, 1], torch.full((4,), 448.0) / torch.full((4,), 2e-3))
    assert torch.equal(amax[:, 0], x[:, :128].abs().amax(1))


def test_an_all_zero_tile_gets_scale_one_and_zero_codes_and_leaves_the_others_alone():
    x = fresh(3, 384, seed=5)
    want = quantize_fp8_tile(x, E4M3, 0)
    x[1, 128:256] = 0.0
    q, scale, descale, amax = quantize_fp8_tile(x, E4M3, 0, True)
    assert amax[1, 1] == 0 and scale[1, 1] == 1 and descale[1, 1] == 1
    assert not q[1, 128:256].view(torch.uint8).any()
    q_exact, scale_exact, _, _ = quantize_fp8_tile(x, E4M3, 0)
    others = torch.ones_like(scale_exact, dtype=torch.bool)
    others[1, 1] = False
    assert torch.equal(scale_exact[others], want[1][others])


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_each_tiles_amax_saturates_to_the_formats_max_and_pow2_scales_stay_below(fmt):
    x = fresh(6, 256, seed=6)
    q, scale, descale, amax = quantize_fp8_tile(x, fmt, 0)
    peak = x.abs().reshape(6, 2, 128).argmax(-1)
    codes = q.float().abs().reshape(6, 2, 128).gather(-1, peak[..., None])
    assert torch.equal(codes, torch.full_like(codes, FMAX[fmt]))  # amax * scale lands on fmax
    _, p2, p2_descale, _ = quantize_fp8_tile(x, fmt, 0, True)
    mantissa, _ = torch.frexp(p2)
    assert torch.equal(mantissa, torch.full_like(p2, 0.5))  # powers of two
    assert torch.all(p2 <= scale) and torch.all(p2 * 2 > scale)
    assert torch.equal(p2 * p2_descale, torch.ones_like(p2))  # exact descales


def test_a_tile_with_inf_or_nan_is_encoded_as_fp8_current_would_and_the_others_keep_their_scales():
    x = fresh(2, 384, seed=7)
    clean = quantize_fp8_tile(x, E4M3, 0)
    x[0, 5] = float("inf")
    x[1, 200] = float("nan")
    q, scale, descale, amax = quantize_fp8_tile(x, E4M3, 0)
    assert amax[0, 0] == float("inf") and scale[0, 0] == 1 and descale[0, 0] == 1
    assert q[0, 5].float() == 448.0  # saturated at scale 1
    assert torch.isnan(amax[1, 1]) and scale[1, 1] == 1
    assert q[1, 200].view(torch.uint8) == 0x7F  # the canonical NaN code
    assert torch.isnan(q[1, 200].float()) and not torch.isnan(q[1, 128:200].float()).any()
    keep = torch.tensor([[False, True, True], [True, False, True]])
    assert torch.equal(scale[keep], clean[1][keep])
    assert torch.equal(q[:, 256:].view(torch.uint8), clean[0][:, 256:].view(torch.uint8))


def test_the_ops_take_2d_inputs_only_and_their_fakes_agree():
    with pytest.raises(ConfigError, match=r"x\.dim\(\)=3 is not allowed"):
        quantize_fp8_tile(torch.ones(2, 3, 4), E4M3)
    x = fresh(130, 260, seed=8, dtype=torch.bfloat16)
    for op in (
        torch.ops.fp8state.quantize_fp8_tile,
        torch.ops.fp8state.quantize_fp8_tile_t,
        torch.ops.fp8state.quantize_fp8_block,
    ):
        torch.library.opcheck(op, (x, E4M3, 0, True), test_utils=("test_schema", "test_faketensor"))
