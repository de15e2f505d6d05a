"""The block-scaled FP8 kernels (``csrc/blockwise_ops.cu``) against their pure-torch references
(``ops/reference_blockwise.py``), bit for bit, on the GPU; and fp8_blockwise's GEMM on the GPU
against its float32 emulation.

Every output is compared: the codes (and the transpose's), the scales, descales and amaxes of
every tile. Inputs are fresh random data over many decades with the edge values of
``test_cuda_ops`` (NaN, infinities, subnormals, values past the format's max) written into some
tiles, an all-zero tile, and shapes of every kind the kernels treat differently: whole and
partial tiles, widths the vector loads and word stores cannot take, a misaligned view.
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state import ops
from lightning_fp8state.ops import library_blockwise as blk
from lightning_fp8state.ops import reference_blockwise as ref
from lightning_fp8state.quant_recipes.blockwise import _uses_scaled_mm, blockwise_matmul
from tests.ops.test_cuda_ops import IN_DTYPES, edge_values, fresh, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)"),
]

FORMATS = pytest.mark.parametrize("fmt", [f8s.E4M3, f8s.E5M2], ids=["e4m3", "e5m2"])
DTYPES = pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
POW2 = pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
# (R, C): whole tiles; partial tiles on both edges; C not a multiple of 4 (no vector loads), R not
# a multiple of 4 (no word stores of the transpose); one row; many tiles; whole 128 x 128 tiles
# beside partial ones with 16-byte loads but R not a multiple of 16 (the whole tiles' transpose
# then element by element); one tile a row (a warp's loads then span rows); C a multiple of 4 but
# not of 8 (16-byte loads for float32 only)
SHAPES = pytest.mark.parametrize(
    "shape", [(256, 512), (200, 300), (131, 258), (130, 6), (1, 129), (1024, 2048), (264, 392), (77, 128), (384, 260)]
)
OPS = ("quantize_fp8_tile", "quantize_fp8_tile_t", "quantize_fp8_block", "quantize_fp8_tile_pair")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"
    missing = [op for op in OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8state::{op}", "CUDA")]
    assert not missing, f"no CUDA kernel registered for {missing}: is csrc/blockwise_ops.cu in ops/cuda.py's SOURCES?"


def data(shape, dtype, fmt, seed: int) -> torch.Tensor:
    r, c = shape
    x = fresh(r * c, dtype, seed=seed).reshape(r, c)
    edges = edge_values(dtype, fmt).cuda()
    n = min(edges.numel(), c)
    if r > 2:
        x[1, :n] = edges[:n]  # row 1's first tiles: NaN, infinities, subnormals, past the max
        x[2, : min(c, 128)] = 0.0  # an all-zero 1x128 tile
    return x


def assert_same(got, want, names) -> None:
    for name, a, b in zip(names, got, want, strict=True):
        assert same_bits(a, b), f"{name} differs from the reference"


@FORMATS
@DTYPES
@POW2
@SHAPES
def test_tile_quantize_matches_reference_bitwise(fmt, dtype, pow2, shape):
    x = data(shape, dtype, fmt, seed=sum(shape))
    got = blk.quantize_fp8_tile(x, fmt.dtype, 1, pow2)
    assert_same(
        got, ref.quantize_fp8_tile_reference(x.cpu(), fmt.dtype, 1, pow2), ("codes", "scale", "descale", "amax")
    )


@FORMATS
@DTYPES
@POW2
@SHAPES
def test_column_tiles_match_reference_bitwise(fmt, dtype, pow2, shape):
    x = data(shape, dtype, fmt, seed=sum(shape) + 1)
    got = blk.quantize_fp8_tile_t(x, fmt.dtype, 0, pow2)
    want = ref.quantize_fp8_tile_t_reference(x.cpu(), fmt.dtype, 0, pow2)
    assert_same(got, want, ("codes_t", "scale", "descale", "amax"))


@FORMATS
@DTYPES
@POW2
@SHAPES
def test_block_quantize_and_its_transpose_match_reference_bitwise(fmt, dtype, pow2, shape):
    x = data(shape, dtype, fmt, seed=sum(shape) + 2)
    got = blk.quantize_fp8_block(x, fmt.dtype, 0, pow2)
    want = ref.quantize_fp8_block_reference(x.cpu(), fmt.dtype, 0, pow2)
    assert_same(got, want, ("codes", "scale", "descale", "amax", "codes_t", "descale_t"))


@FORMATS
@DTYPES
@POW2
# whole 128 x 128 tiles (one kernel reads x once: tall, wide, one tile row); the others (the two
# kernels): partial tiles, C a multiple of 4 only
@pytest.mark.parametrize("shape", [(256, 512), (640, 128), (128, 1024), (200, 300), (256, 260), (131, 258)])
def test_tile_pair_is_both_tilings_bitwise(fmt, dtype, pow2, shape):
    x = data(shape, dtype, fmt, seed=sum(shape) + 3)
    got = blk.quantize_fp8_tile_pair(x, fmt.dtype, 1, pow2)
    want = ref.quantize_fp8_tile_pair_reference(x.cpu(), fmt.dtype, 1, pow2)
    assert_same(got, want, ("codes", "scale", "descale", "amax", "codes_t", "descale_t"))
    separate = (*blk.quantize_fp8_tile(x, fmt.dtype, 1, pow2), *blk.quantize_fp8_tile_t(x, fmt.dtype, 1, pow2)[::2])
    assert_same(got, separate, ("codes", "scale", "descale", "amax", "codes_t", "descale_t"))


def test_views_and_empty_inputs():
    base = fresh(300 * 260, torch.bfloat16, seed=9).reshape(300, 260)
    # whole tiles at a base that 16-byte loads cannot take (one element past an aligned one)
    shifted = fresh(1 + 256 * 384, torch.bfloat16, seed=10)[1:].view(256, 384)
    for view in (base[1:, 3:], base.t(), base[:, ::2], shifted):
        for op, reference in (
            (blk.quantize_fp8_tile, ref.quantize_fp8_tile_reference),
            (blk.quantize_fp8_tile_t, ref.quantize_fp8_tile_t_reference),
            (blk.quantize_fp8_block, ref.quantize_fp8_block_reference),
            (blk.quantize_fp8_tile_pair, ref.quantize_fp8_tile_pair_reference),
        ):
            got = op(view, torch.float8_e4m3fn, 0, False)
            want = reference(view.cpu(), torch.float8_e4m3fn, 0, False)
            assert all(same_bits(a, b) for a, b in zip(got, want, strict=True)), op.__name__
    for shape in ((0, 5), (5, 0), (0, 0)):
        x = torch.empty(shape, device="cuda")
        for op, reference in (
            (blk.quantize_fp8_tile, ref.quantize_fp8_tile_reference),
            (blk.quantize_fp8_tile_t, ref.quantize_fp8_tile_t_reference),
            (blk.quantize_fp8_block, ref.quantize_fp8_block_reference),
            (blk.quantize_fp8_tile_pair, ref.quantize_fp8_tile_pair_reference),
        ):
            got = op(x, torch.float8_e4m3fn)
            want = reference(x.cpu(), torch.float8_e4m3fn, 0, False)
            assert all(same_bits(a, b) for a, b in zip(got, want, strict=True)), (op.__name__, shape)


@pytest.mark.parametrize("per_column", [False, True], ids=["128x128", "128x1"])
def test_the_gemm_on_the_gpu_is_its_emulation_up_to_accumulation_order(per_column):
    g = torch.Generator(device="cuda").manual_seed(3)
    m, k, n = 256, 1024, 384
    # clamped to E4M3's range: torch's cast of a larger value gives NaN, not the format's max
    a = (torch.randn(m, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).t()
    da = torch.rand(m, k // 128, device="cuda", generator=g) + 0.5
    db = torch.rand(k // 128, n if per_column else n // 128, device="cuda", generator=g) + 0.5
    if not _uses_scaled_mm(a, b, torch.bfloat16, "auto"):
        pytest.skip("this torch/GPU has no block-scaled FP8 GEMM (sm90, CUDA 12.9+): the emulation runs")
    got = blockwise_matmul(a, b, da, db, torch.bfloat16, "auto").float()
    want = blockwise_matmul(a, b, da, db, torch.float32, "emulated")
    assert want.isfinite().all() and want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3 * want.abs().max().item())


def test_the_gpu_gemm_adds_its_bias_in_float32_and_rounds_once():
    """The block-scaled GEMM writes bfloat16; its bias is added in float32 in place, rounded
    once: bitwise ``(product.float() + bias).to(out_dtype)`` for bfloat16 and float32 outputs."""
    g = torch.Generator(device="cuda").manual_seed(4)
    m, k, n = 272, 512, 256
    a = (torch.randn(m, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).t()
    da = torch.rand(m, k // 128, device="cuda", generator=g) + 0.5
    db = torch.rand(k // 128, n // 128, device="cuda", generator=g) + 0.5
    bias = torch.randn(n, device="cuda", generator=g) * 1000
    if not _uses_scaled_mm(a, b, torch.bfloat16, "auto"):
        pytest.skip("this torch/GPU has no block-scaled FP8 GEMM (sm90, CUDA 12.9+): the emulation runs")
    product = blockwise_matmul(a, b, da, db, torch.bfloat16, "auto")
    assert product.abs().max() > 0
    for out_dtype in (torch.bfloat16, torch.float32):
        got = blockwise_matmul(a, b, da, db, out_dtype, "auto", bias)
        assert got.dtype == out_dtype
        assert same_bits(got, (product.float() + bias).to(out_dtype)), out_dtype
