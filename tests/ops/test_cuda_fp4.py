"""The packed-FP4 CUDA kernels (csrc/fp4_ops.cu) against the pure-torch reference, bit for bit.

Every test runs an op on CUDA and the same op on CPU copies of its arguments (on CPU the op is
the reference in ops/reference_fp4.py) and compares every output and every mutated argument
as raw bytes. A mismatch names the op, the element or channel, and for packed codes the block's
input values, so a failure says what went wrong without a debugger.

Skipped with a reason where there is no CUDA device. On a CUDA machine the kernels MUST build
and load: a failed build fails these tests instead of silently testing the reference fallback.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from lightning_fp8state import ops
from tests.ops.kernel_data import (
    FULL_RANGE_SCALES,
    assert_beside_the_imported_package,
    full_range,
    put_negative_nan,
    subnormal_tie_block,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)"),
]

OPS = torch.ops.fp8state
LAYOUTS = ["nvfp4", "mxfp4"]
BLOCK = {"nvfp4": 16, "mxfp4": 32}
SCALE_DTYPE = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.float8_e8m0fnu}
FMAX = {"nvfp4": 2688.0, "mxfp4": 6.0}
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN_BITS = 0x7FC00000


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"
    return ops.cuda.extension_info()


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str, x: torch.Tensor | None = None, layout=None):
    """Bitwise equality of dtype, shape and bytes; on failure, the first differing elements."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = raw(got), raw(want)
    if torch.equal(g, w):
        return
    width = got.element_size()
    bad = (g != w).nonzero().reshape(-1)
    elems = sorted({int(i) // width for i in bad.tolist()})[:4]
    lines = [f"{what}: {len(elems)}+ elements differ (of {got.numel()}), shape {tuple(got.shape)}"]
    flat_g, flat_w = got.detach().cpu().reshape(-1), want.detach().cpu().reshape(-1)
    for e in elems:
        gb = g[e * width : (e + 1) * width].tolist()
        wb = w[e * width : (e + 1) * width].tolist()
        line = f"  element {e}: got bytes {gb} ({_show(flat_g[e])}), want {wb} ({_show(flat_w[e])})"
        if x is not None and layout is not None and got.dtype == torch.uint8:  # packed codes
            k = x.shape[-1]
            b = BLOCK[layout]
            first = (2 * e) // b * b  # first element of the block (flattened x)
            xs = x.detach().cpu().float().reshape(-1)[first : first + b].tolist()
            line += f"; block of x elements {first}..{first + b - 1} (row {first // k}): {[float.hex(v) for v in xs]}"
        lines.append(line)
    raise AssertionError("\n".join(lines))


def _show(v: torch.Tensor) -> str:
    if v.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return hex(int(v.view(torch.uint8)))
    return repr(float(v.float()))


def fresh(shape, dtype: torch.dtype, seed: int, decades: float = 3.0) -> torch.Tensor:
    """Random values of both signs spanning many decades (log-normal magnitudes), with a random
    power-of-two scale per row so blocks differ in magnitude too; never all zeros."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    mag = torch.exp(torch.randn(shape, device="cuda", generator=g) * decades)
    rows = torch.randint(-12, 13, (*shape[:-1], 1), device="cuda", generator=g).float()
    sign = torch.where(torch.rand(shape, device="cuda", generator=g) < 0.5, -1.0, 1.0)
    v = mag * torch.exp2(rows) * sign
    lim = torch.finfo(dtype).max / 4
    return v.clamp(-lim, lim).to(dtype)


def edge_values(dtype: torch.dtype) -> list[float]:
    fi = torch.finfo(dtype)
    return [
        0.0,
        -0.0,
        fi.tiny,
        -fi.tiny,
        fi.tiny / 4,  # a subnormal of the input dtype
        fi.max,
        -fi.max,
        math.inf,
        -math.inf,
        math.nan,
        6.0,
        -6.0,
        5.0,
        448.0,
        2688.0,
        2688.0 * 1.5,
        0.25,
        0.75,
        7.99,
        8.0,
        1e-30 if dtype != torch.float16 else 1e-7,
    ]


def with_edges(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x with edge blocks spliced in: one block holding every edge value (NaN included), one
    with an infinity among ordinary values, one all +-0, one of input-dtype subnormals, one
    at the block-scale maximum (NVFP4 scale saturates at 448, elements at 6 * sb), one with
    a NaN among ordinary values, one all -6, one with a negative NaN."""
    x = x.clone()
    flat = x.reshape(-1)
    b = BLOCK[layout]
    n_blocks = flat.numel() // b
    edges = torch.tensor(edge_values(x.dtype), dtype=torch.float32).to(x.dtype).to(x.device)
    plans = [
        lambda blk: blk[: min(b, edges.numel())].copy_(edges[: min(b, edges.numel())]),
        lambda blk: blk.__setitem__(b // 2, math.inf),
        lambda blk: blk.copy_(torch.where(torch.arange(b, device=x.device) % 2 == 0, 0.0, -0.0).to(x.dtype)),
        lambda blk: blk.copy_(torch.full((b,), torch.finfo(x.dtype).tiny / 8, device=x.device).to(x.dtype)),
        lambda blk: blk.__setitem__(0, 2688.0 * 4),  # NVFP4 with S = 1: v = 1792 -> sb 448
        lambda blk: blk.__setitem__(1, math.nan),
        lambda blk: blk.__setitem__(slice(None), -6.0),
        lambda blk: put_negative_nan(blk, 3),
    ]
    for i, plan in enumerate(plans):
        if 2 * i + 1 < n_blocks:
            plan(flat[(2 * i + 1) * b : (2 * i + 2) * b])
    return x


def tensor_scale(x: torch.Tensor, layout: str) -> float:
    """The scale a settled owner would use: fmax / amax (finite values only)."""
    a = x.float().abs()
    a = a[torch.isfinite(a)]
    amax = float(a.max()) if a.numel() else 1.0
    return FMAX[layout] / amax if amax > 0 else 1.0


def scalar(v: float) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float32, device="cuda")


def stats_rows(n_owners: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """center_max / center_min buffers: mostly the reset values (-inf / +inf), some channels
    holding earlier observations, +-0 and one NaN, so the fold's ordering shows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cmax = torch.full((n_owners, width), -math.inf, device="cuda")
    cmin = torch.full((n_owners, width), math.inf, device="cuda")
    pick = torch.rand(n_owners, width, device="cuda", generator=g) < 0.3
    vals = torch.randn(n_owners, width, device="cuda", generator=g) * 10
    cmax = torch.where(pick, vals, cmax)
    cmin = torch.where(pick, vals - 1, cmin)
    if width >= 4:
        cmax[:, 0], cmin[:, 0] = 0.0, 0.0
        cmax[:, 1], cmin[:, 1] = -0.0, -0.0
        cmax[:, 2], cmin[:, 2] = math.nan, 5.0
    return cmax, cmin


def run_all_quantize_ops(x, scale, layout, center, what, seed=0):
    """quantize_fp4 (plain and centered), quantize_fp4_record_amax and
    quantize_fp4_centered_record on CUDA against the same ops on CPU copies."""
    xc, sc = x.cpu(), scale.cpu()
    cc = center.cpu()
    tag = f"{what} {layout} {x.dtype} {tuple(x.shape)} S={float(scale):g}"

    got, want = OPS.quantize_fp4(x, scale, None, layout), OPS.quantize_fp4(xc, sc, None, layout)
    assert_same(got[0], want[0], f"quantize_fp4 packed [{tag}]", x, layout)
    assert_same(got[1], want[1], f"quantize_fp4 block_scales [{tag}]")

    got, want = OPS.quantize_fp4(x, scale, center, layout), OPS.quantize_fp4(xc, sc, cc, layout)
    assert_same(got[0], want[0], f"quantize_fp4(center) packed [{tag}]", x, layout)
    assert_same(got[1], want[1], f"quantize_fp4(center) block_scales [{tag}]")

    pending = torch.rand(4, device="cuda") * 1e-3
    p_cpu = pending.cpu()
    got = OPS.quantize_fp4_record_amax(x, scale, pending, 2, layout)
    want = OPS.quantize_fp4_record_amax(xc, sc, p_cpu, 2, layout)
    assert_same(got[0], want[0], f"record_amax packed [{tag}]", x, layout)
    assert_same(got[1], want[1], f"record_amax block_scales [{tag}]")
    assert_same(pending, p_cpu, f"record_amax amax_pending [{tag}]")

    k = x.shape[-1]
    pending = torch.rand(3, device="cuda") * 1e-3
    cmax, cmin = stats_rows(3, k + 5, seed)
    p_cpu, cmax_cpu, cmin_cpu = pending.cpu(), cmax.cpu(), cmin.cpu()
    got = OPS.quantize_fp4_centered_record(x, scale, center, pending, cmax, cmin, 1, layout)
    want = OPS.quantize_fp4_centered_record(xc, sc, cc, p_cpu, cmax_cpu, cmin_cpu, 1, layout)
    assert_same(got[0], want[0], f"centered_record packed [{tag}]", x, layout)
    assert_same(got[1], want[1], f"centered_record block_scales [{tag}]")
    assert_same(pending, p_cpu, f"centered_record amax_pending [{tag}]")
    assert_same(cmax, cmax_cpu, f"centered_record center_max [{tag}]")
    assert_same(cmin, cmin_cpu, f"centered_record center_min [{tag}]")


def random_center(k: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + 101)
    return (torch.randn(k, device="cuda", generator=g) * spread).float()


def shapes_for(layout: str):
    ks = [16, 32, 64, 4096] if layout == "nvfp4" else [32, 64, 4096]
    return [(r, k) for r in (1, 3, 1000) for k in ks] + [(2, 3, 5, 64)]


CASES = [(lay, shape) for lay in LAYOUTS for shape in shapes_for(lay)]


# --------------------------------------------------------------------------------------
# quantize: fresh data, edge blocks, every size
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize(("layout", "shape"), CASES, ids=[f"{lay}-{'x'.join(map(str, s))}" for lay, s in CASES])
def test_quantize_ops_match_reference_bitwise(layout, shape, dtype):
    seed = zlib.crc32(f"{layout}{shape}{dtype}".encode())
    x = with_edges(fresh(shape, dtype, seed), layout)
    center = random_center(shape[-1], seed)
    for s in (1.0, tensor_scale(x, layout)):
        run_all_quantize_ops(x, scalar(s), layout, center, "fresh+edges", seed)
    # edge-free data too (a NaN block elsewhere must not be what makes the others agree)
    y = fresh(shape, dtype, seed + 1)
    run_all_quantize_ops(y, scalar(tensor_scale(y, layout)), layout, center, "fresh", seed)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_special_tensor_scales(layout, dtype):
    """Zero, negative, infinite, NaN, tiny and huge tensor scales: every rule for S holds."""
    x = with_edges(fresh((7, 64), dtype, 5), layout)
    center = random_center(64, 5)
    for s in (0.0, -0.0, -1.5, math.inf, -math.inf, math.nan, 2.0**-149, 1e-38, 3e38, 2688.0, 6.0):
        run_all_quantize_ops(x, scalar(s), layout, center, "special S", 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_full_exponent_range(layout, dtype):
    """Every tensor scale against blocks from every binade: the rounding of x * S and of the
    block-scaled value agree with the reference wherever they under- or overflow."""
    x = full_range((64, 256), dtype, 17, "cuda")
    center = random_center(256, 17)
    for s in FULL_RANGE_SCALES:
        run_all_quantize_ops(x, scalar(s), layout, center, "full range", 17)


def test_mxfp4_subnormal_product_on_a_tie():
    x, s = subnormal_tie_block()
    packed, _ = OPS.quantize_fp4(x, torch.tensor([s]), None, "mxfp4")
    assert int(packed[0, 0]) == 0x80  # codes 0 and -0: the tie rounded twice, as the rule says
    run_all_quantize_ops(x.cuda(), scalar(s), "mxfp4", torch.zeros(32, device="cuda"), "subnormal tie", 3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_special_centers(layout):
    """Centers holding +-0, infinities and NaN (x - c may be NaN or infinite)."""
    x = fresh((5, 64), torch.bfloat16, 9)
    x[0, :4] = torch.tensor([math.inf, -math.inf, 0.0, -0.0])
    center = random_center(64, 9)
    center[:8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 3e38, -3e38])
    run_all_quantize_ops(x, scalar(1.0), layout, center, "special center", 9)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_rounding_of_every_e2m1_value_and_tie(layout):
    """Blocks whose element encode factor is exactly 1 (as in the CPU format tests): every
    E2M1 value, every tie and values past 6, both signs, plus 1-ulp neighbours of each tie."""
    targets = [0.0, 0.1, 0.25, 0.3, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.9, 5.0, 5.1, 6.0]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # float32 neighbours of each tie
    targets += torch.nextafter(ties, torch.zeros(())).tolist() + torch.nextafter(ties, torch.full((), 10.0)).tolist()
    rows = []
    for t in targets:
        for sign in (1.0, -1.0):
            rows.append([6.0] + [sign * t] * (BLOCK[layout] - 1))
    x = torch.tensor(rows, dtype=torch.float32, device="cuda")
    run_all_quantize_ops(x, scalar(1.0), layout, torch.zeros(x.shape[-1], device="cuda"), "ties", 0)


# a negative NaN of each 16-bit type (the min's side of the NaN check): 0xFFC0, 0xFE00
NEG_NAN_BITS = {torch.bfloat16: -64, torch.float16: -512}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_centered_record_statistics_with_many_rows_and_contention(dtype):
    """20000 rows of 16 channels: hundreds of CTAs fold the same 32 statistics (CAS loop), and
    +-0 / NaN in single channels; 1 row: one CTA, no atomics. (16-bit inputs keep 16-bit
    statistics keys in registers: both types' NaN, +-0 and extremes go through them.)"""
    for rows in (20000, 1):
        x = fresh((rows, 16), dtype, rows)
        x[rows // 2, 3] = math.nan
        x.view(torch.int16)[rows // 3, 4] = NEG_NAN_BITS[dtype]
        x[rows // 4, 7] = torch.finfo(dtype).max
        x[rows // 5, 8] = -torch.finfo(dtype).max
        x[:, 5] = -0.0
        x[: rows // 2, 6] = 0.0
        x[rows // 2 :, 6] = -0.0
        center = random_center(16, 1)
        run_all_quantize_ops(x, scalar(0.5), "nvfp4", center, "contention", rows)


def test_record_ops_keep_a_larger_or_nan_pending_amax():
    x = fresh((3, 64), torch.bfloat16, 3)
    for init in (1e30, math.nan, 0.0):
        pending = torch.full((2,), init, device="cuda")
        p_cpu = pending.cpu()
        OPS.quantize_fp4_record_amax(x, scalar(1.0), pending, 1, "nvfp4")
        OPS.quantize_fp4_record_amax(x.cpu(), scalar(1.0).cpu(), p_cpu, 1, "nvfp4")
        assert_same(pending, p_cpu, f"pending after init {init}")
    y = x.clone()
    y[1, 7] = math.nan
    pending = torch.zeros(1, device="cuda")
    OPS.quantize_fp4_record_amax(y, scalar(1.0), pending, 0, "mxfp4")
    assert int(raw(pending).view(torch.int32)) == NAN_BITS  # the canonical NaN


def test_zero_size_inputs():
    for layout in LAYOUTS:
        for shape in ((0, 32), (3, 0), (0,)):
            x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
            k = shape[-1]
            s = scalar(1.0)
            got, want = OPS.quantize_fp4(x, s, None, layout), OPS.quantize_fp4(x.cpu(), s.cpu(), None, layout)
            assert_same(got[0], want[0], f"empty packed {shape}")
            assert_same(got[1], want[1], f"empty scales {shape}")
            pending = torch.full((1,), 0.5, device="cuda")
            cmax, cmin = stats_rows(1, k + 1, 0)
            before = (cmax.clone(), cmin.clone())
            OPS.quantize_fp4_centered_record(x, s, torch.zeros(k, device="cuda"), pending, cmax, cmin, 0, layout)
            assert (
                float(pending) == 0.5
                and torch.equal(raw(cmax), raw(before[0]))
                and torch.equal(raw(cmin), raw(before[1]))
            )
            d = OPS.dequantize_fp4(got[0], got[1], s, None, layout, torch.bfloat16)
            assert tuple(d.shape) == shape


# --------------------------------------------------------------------------------------
# layouts the kernels copy first: non-contiguous, misaligned, broadcast
# --------------------------------------------------------------------------------------


def test_non_contiguous_and_misaligned_views():
    base = fresh((64, 130), torch.bfloat16, 7)
    flat = fresh((4 * 64 + 3,), torch.bfloat16, 8)
    cbig = random_center(400, 7)
    views = {
        "column slice": base[:3, :64],
        "transpose": base[:32, :64].t(),  # (64, 32)
        "misaligned": flat[1 : 1 + 4 * 64].view(4, 64),
        "broadcast": base[0:1, :64].expand(5, 64),
        "row step": base[::2, :96],
    }
    for name, v in views.items():
        k = v.shape[-1]
        for layout in LAYOUTS:
            if k % BLOCK[layout]:
                continue
            for center in (cbig[::3][:k], cbig[1 : 1 + k]):  # strided, misaligned
                run_all_quantize_ops(v, scalar(2.0), layout, center, f"view {name}", 1)
                got = OPS.quantize_fp4(v, scalar(2.0), center, layout)
                assert got[0].is_contiguous() and got[1].is_contiguous()
    # strided center_max / center_min (a transposed buffer) and a strided pending vector
    x = fresh((9, 64), torch.float32, 4)
    cmax_t, cmin_t = (t.t().contiguous().t() for t in stats_rows(3, 70, 4))
    pend = torch.zeros(6, device="cuda")[::2]
    args_cpu = [t.cpu() for t in (pend, cmax_t, cmin_t)]
    c = random_center(64, 4)
    got = OPS.quantize_fp4_centered_record(x, scalar(1.0), c, pend, cmax_t, cmin_t, 2, "nvfp4")
    want = OPS.quantize_fp4_centered_record(x.cpu(), scalar(1.0).cpu(), c.cpu(), *args_cpu, 2, "nvfp4")
    assert_same(got[0], want[0], "strided stats packed")
    for g_t, w_t, name in zip((pend, cmax_t, cmin_t), args_cpu, ("pending", "center_max", "center_min"), strict=True):
        assert_same(g_t, w_t, f"strided {name}")


# --------------------------------------------------------------------------------------
# dequantize
# --------------------------------------------------------------------------------------

DESCALES = [1.0, 2.0**-7, 0.0123, 1 / 2688.0, 3e38, 0.0, -2.5, math.inf, math.nan, 2.0**-140]


@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantize_every_byte_and_block_scale_code(layout, out_dtype):
    """Every packed byte under every block-scale code (E4M3 NaN 0x7F/0xFF and negative codes,
    E8M0 0 / 254 / NaN 255), every descale rule (0, inf, NaN, negative, huge, tiny), with and
    without a center holding +-0, infinities and NaN."""
    b = BLOCK[layout]
    k = 256 * b  # a row: 256 blocks, block j has scale code j
    g = torch.Generator(device="cuda").manual_seed(1)
    packed = torch.randint(0, 256, (2, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    packed[0, :128] = torch.arange(128, dtype=torch.uint8, device="cuda")
    packed[0, 128:256] = torch.arange(128, 256, dtype=torch.int32, device="cuda").to(torch.uint8)
    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8).repeat(2, 1)
    scales = codes.view(SCALE_DTYPE[layout])
    center = random_center(k, 3)
    center[:6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3e38])
    for d in DESCALES:
        for c in (None, center):
            got = OPS.dequantize_fp4(packed, scales, scalar(d), c, layout, out_dtype)
            want = OPS.dequantize_fp4(
                packed.cpu(), scales.cpu(), scalar(d).cpu(), None if c is None else c.cpu(), layout, out_dtype
            )
            assert_same(got, want, f"dequantize_fp4 {layout} -> {out_dtype} descale={d!r} center={c is not None}")


@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize(("layout", "shape"), CASES, ids=[f"{lay}-{'x'.join(map(str, s))}" for lay, s in CASES])
def test_dequantize_of_quantized_data_matches_reference(layout, shape, out_dtype):
    x = with_edges(fresh(shape, torch.bfloat16, 11), layout)
    s = tensor_scale(x, layout)
    center = random_center(shape[-1], 11)
    for c in (None, center):
        packed, scales = OPS.quantize_fp4(x, scalar(s), c, layout)
        for d in (1 / s, 1.0):
            got = OPS.dequantize_fp4(packed, scales, scalar(d), c, layout, out_dtype)
            want = OPS.dequantize_fp4(
                packed.cpu(), scales.cpu(), scalar(d).cpu(), None if c is None else c.cpu(), layout, out_dtype
            )
            assert_same(got, want, f"dequantize_fp4 {layout} {tuple(shape)} -> {out_dtype} center={c is not None}")


def test_dequantize_non_contiguous_and_misaligned_inputs():
    x = fresh((6, 128), torch.float32, 12)
    packed, scales = OPS.quantize_fp4(x, scalar(3.0), None, "nvfp4")
    store = torch.zeros(packed.numel() + 1, dtype=torch.uint8, device="cuda")
    store[1:] = packed.reshape(-1)
    cases = {
        "column slice": (packed[:, :32], scales[:, :4]),
        "row step": (packed[::2], scales[::2]),
        "misaligned": (store[1:].view(6, 64), scales),
    }
    cbig = random_center(300, 12)
    for name, (p, sc) in cases.items():
        k = 2 * p.shape[-1]
        for c in (None, cbig[::2][:k], cbig[1 : 1 + k]):
            got = OPS.dequantize_fp4(p, sc, scalar(0.25), c, "nvfp4", torch.bfloat16)
            want = OPS.dequantize_fp4(
                p.cpu(), sc.cpu(), scalar(0.25).cpu(), None if c is None else c.cpu(), "nvfp4", torch.bfloat16
            )
            assert got.is_contiguous()
            assert_same(got, want, f"dequantize view {name}")


# --------------------------------------------------------------------------------------
# update_centers
# --------------------------------------------------------------------------------------


def random_center_bank(n: int, c: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    center = torch.randn(n, c, generator=g) * 5
    cmax = center + torch.rand(n, c, generator=g) * 3
    cmin = center - torch.rand(n, c, generator=g) * 3
    fresh_rows = torch.rand(n, c, generator=g) < 0.2  # nothing recorded
    cmax = torch.where(fresh_rows, -math.inf, cmax)
    cmin = torch.where(fresh_rows, math.inf, cmin)
    specials = [math.nan, math.inf, -math.inf, 0.0, -0.0, 3e38, -3e38, 1e-45]
    for i, v in enumerate(specials):
        if i < c:
            cmax[i % n, i] = v
            cmin[(i + 1) % n, i] = v
    if c > 9:
        center[0, 8] = math.nan  # a NaN center with finite statistics: NaN out, canonical
        center[0, 9] = -0.0
        cmax[0, 8:10], cmin[0, 8:10] = 1.0, -1.0
    mask = torch.rand(n, generator=g) < 0.7
    return center, cmax, cmin, mask


@pytest.mark.parametrize("n", [1, 64, 1000])
@pytest.mark.parametrize("c", [1, 16, 200])
def test_update_centers_matches_reference_bitwise(n, c):
    for momentum in (1.0, 0.5, 0.1, 0.3, 1e-3):
        cpu = random_center_bank(n, c, seed=n * 1000 + c)
        gpu = [t.cuda() for t in cpu]
        ops.update_centers_reference(*cpu, momentum)
        OPS.update_centers(*gpu, momentum)
        for name, a, b in zip(("center", "center_max", "center_min", "mask"), gpu, cpu, strict=True):
            assert_same(a, b, f"update_centers {name} (n={n}, c={c}, momentum={momentum})")


def test_update_centers_strided_buffers():
    cpu = random_center_bank(8, 24, seed=5)
    gpu = [t.cuda().t().contiguous().t() if t.dim() == 2 else t.cuda() for t in cpu]  # column-major
    gpu[3] = torch.stack([gpu[3], gpu[3]], 1)[:, 0]  # strided mask
    ops.update_centers_reference(*cpu, 0.25)
    OPS.update_centers(*gpu, 0.25)
    for name, a, b in zip(("center", "center_max", "center_min"), gpu, cpu, strict=False):
        assert_same(a, b, f"strided update_centers {name}")


# --------------------------------------------------------------------------------------
# registration: opcheck, torch.compile, no host sync, argument errors
# --------------------------------------------------------------------------------------

_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_every_fp4_op_on_cuda(layout):
    x = fresh((3, 64), torch.bfloat16, 3)
    s = scalar(2.0)
    c = random_center(64, 3)
    torch.library.opcheck(OPS.quantize_fp4.default, (x, s, None, layout), test_utils=_UTILS)
    torch.library.opcheck(OPS.quantize_fp4.default, (x, s, c, layout), test_utils=_UTILS)
    torch.library.opcheck(
        OPS.quantize_fp4_record_amax.default, (x, s, torch.zeros(2, device="cuda"), 1, layout), test_utils=_UTILS
    )
    stats = stats_rows(2, 64, 0)
    torch.library.opcheck(
        OPS.quantize_fp4_centered_record.default,
        (x, s, c, torch.zeros(2, device="cuda"), *stats, 0, layout),
        test_utils=_UTILS,
    )
    packed, scales = OPS.quantize_fp4(x, s, None, layout)
    for center in (None, c):
        torch.library.opcheck(
            OPS.dequantize_fp4.default, (packed, scales, s, center, layout, torch.bfloat16), test_utils=_UTILS
        )
    bank = [t.cuda() for t in random_center_bank(3, 4, seed=1)]
    bank[:3] = [torch.nan_to_num(t) for t in bank[:3]]  # test_schema compares with allclose
    torch.library.opcheck(OPS.update_centers.default, (*bank, 0.25), test_utils=(*_UTILS, "test_schema"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_compile_fullgraph_quantize_dequantize(layout):
    """quantize + dequantize under torch.compile(fullgraph=True), equal to eager bit for bit.

    The MXFP4 *recording* op is compiled with the aot_eager backend: in torch 2.13 inductor
    cannot lower a mutating custom op with a float8_e8m0fnu output (its pattern matcher skips
    e8m0 nodes, so auto_functionalized_v2 is never decomposed: "auto_functionalized_v2 was not
    removed", on CPU with the reference as well). The non-mutating ops go through inductor."""

    def f(x, scale, descale, pending):
        packed, scales = torch.ops.fp8state.quantize_fp4_record_amax(x, scale, pending, 0, layout)
        return torch.ops.fp8state.dequantize_fp4(packed, scales, descale, None, layout, torch.bfloat16) * 2

    def g(x, scale, descale, center):  # the public wrappers
        packed, scales = ops.quantize_fp4(x, scale, layout, center)
        return ops.dequantize_fp4(packed, scales, descale, layout, torch.float32, center) + 1

    x = fresh((64, 128), torch.bfloat16, 11)
    s = scalar(tensor_scale(x, layout))
    d = 1 / s
    c = random_center(128, 11)
    p_eager, p_comp = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    eager = f(x, s, d, p_eager)
    backend = "inductor" if layout == "nvfp4" else "aot_eager"
    out = torch.compile(f, fullgraph=True, backend=backend)(x, s, d, p_comp)
    assert_same(out, eager, "compiled quantize+dequantize")
    assert_same(p_comp, p_eager, "compiled pending amax")
    assert_same(torch.compile(g, fullgraph=True)(x, s, d, c), g(x, s, d, c), "compiled wrappers")


def test_no_host_sync_in_any_fp4_op():
    x = fresh((256, 256), torch.bfloat16, 5)
    s = scalar(2.0)
    c = random_center(256, 5)
    pending = torch.zeros(4, device="cuda")
    cmax, cmin = stats_rows(4, 256, 5)
    bank = [t.cuda() for t in random_center_bank(16, 64, seed=2)]
    misaligned = fresh((257 * 64,), torch.bfloat16, 6)[1 : 1 + 256 * 64].view(256, 64)
    packed = {lay: OPS.quantize_fp4(x, s, None, lay) for lay in LAYOUTS}
    calls = []
    for lay in LAYOUTS:
        p, sc = packed[lay]
        calls += [
            lambda lay=lay: ops.quantize_fp4(x, s, lay),
            lambda lay=lay: ops.quantize_fp4(x, s, lay, c),
            lambda lay=lay: ops.quantize_fp4(misaligned, s, lay),
            lambda lay=lay: ops.quantize_fp4(x.float(), s, lay),
            lambda lay=lay: ops.quantize_fp4_record_amax(x, s, pending, 1, lay),
            lambda lay=lay: ops.quantize_fp4_centered_record(x, s, c, pending, cmax, cmin, 2, lay),
            lambda lay=lay, p=p, sc=sc: ops.dequantize_fp4(p, sc, s, lay, torch.bfloat16),
            lambda lay=lay, p=p, sc=sc: ops.dequantize_fp4(p, sc, s, lay, torch.float32, c),
        ]
    calls.append(lambda: ops.update_centers(*bank, 0.5))
    for call in calls:  # warm-up (lazy load, occupancy queries) outside the check
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_kernel_argument_errors_match_the_reference_and_name_the_argument():
    """The same bad call raises the same "<arg>=<found> is not allowed: expected X" ValueError on
    CUDA (C++ checks) as on CPU (Python checks)."""

    def calls(dev):
        x = torch.randn(2, 32, device=dev)
        s = torch.ones(1, device=dev)
        pend = torch.zeros(2, device=dev)
        packed, scales = OPS.quantize_fp4(x, s, None, "nvfp4")
        z = torch.zeros(1, 2, device=dev)
        return {
            "layout": lambda: OPS.quantize_fp4(x, s, None, "fp4"),
            "x.shape[-1]": lambda: OPS.quantize_fp4(torch.randn(2, 16, device=dev), s, None, "mxfp4"),
            "x.dtype": lambda: OPS.quantize_fp4(x.double(), s, None, "nvfp4"),
            "scale.dtype": lambda: OPS.quantize_fp4(x, s.double(), None, "nvfp4"),
            "scale.numel()": lambda: OPS.quantize_fp4(x, torch.ones(2, device=dev), None, "nvfp4"),
            "center.shape": lambda: OPS.quantize_fp4(x, s, torch.zeros(16, device=dev), "nvfp4"),
            "center.dtype": lambda: OPS.quantize_fp4(x, s, torch.zeros(32, device=dev).double(), "nvfp4"),
            "slot": lambda: OPS.quantize_fp4_record_amax(x, s, pend, 2, "nvfp4"),
            "amax_pending.dtype": lambda: OPS.quantize_fp4_record_amax(x, s, pend.double(), 0, "nvfp4"),
            "center_max.shape[1]": lambda: OPS.quantize_fp4_centered_record(
                x,
                s,
                torch.zeros(32, device=dev),
                pend,
                torch.zeros(2, 16, device=dev),
                torch.zeros(2, 16, device=dev),
                0,
                "nvfp4",
            ),
            "center_min.shape": lambda: OPS.quantize_fp4_centered_record(
                x,
                s,
                torch.zeros(32, device=dev),
                pend,
                torch.zeros(2, 32, device=dev),
                torch.zeros(3, 32, device=dev),
                0,
                "nvfp4",
            ),
            "center_max.dim()": lambda: OPS.quantize_fp4_centered_record(
                x,
                s,
                torch.zeros(32, device=dev),
                pend,
                torch.zeros(32, device=dev),
                torch.zeros(32, device=dev),
                0,
                "nvfp4",
            ),
            "packed.dtype": lambda: OPS.dequantize_fp4(packed.int(), scales, s, None, "nvfp4", torch.float32),
            "block_scales.dtype": lambda: OPS.dequantize_fp4(
                packed, scales.view(torch.uint8), s, None, "nvfp4", torch.float32
            ),
            "block_scales.shape": lambda: OPS.dequantize_fp4(packed, scales[:, :1], s, None, "nvfp4", torch.float32),
            "2 * packed.shape[-1]": lambda: OPS.dequantize_fp4(packed[:, :4], scales, s, None, "nvfp4", torch.float32),
            "dtype": lambda: OPS.dequantize_fp4(packed, scales, s, None, "nvfp4", torch.float64),
            "descale.numel()": lambda: OPS.dequantize_fp4(
                packed, scales, torch.ones(3, device=dev), None, "nvfp4", torch.float32
            ),
            "momentum": lambda: OPS.update_centers(z, z.clone(), z.clone(), torch.tensor([True], device=dev), 1.5),
            "commit_mask.dtype": lambda: OPS.update_centers(
                z, z.clone(), z.clone(), torch.tensor([1], device=dev), 0.5
            ),
            "commit_mask.shape": lambda: OPS.update_centers(
                z, z.clone(), z.clone(), torch.tensor([True, False], device=dev), 0.5
            ),
            "center_max.shape": lambda: OPS.update_centers(
                z, torch.zeros(1, 3, device=dev), z.clone(), torch.tensor([True], device=dev), 0.5
            ),
        }

    cpu_calls, cuda_calls = calls("cpu"), calls("cuda")
    for name in cpu_calls:
        want, got = _error(cpu_calls[name]), _error(cuda_calls[name])
        assert got.startswith(f"{name}=") and " is not allowed: expected " in got, (name, got)
        assert got == want, f"{name}: CUDA says {got!r}, CPU says {want!r}"
    x = torch.randn(2, 32, device="cuda")
    assert "scale.device=cpu is not allowed: expected cuda:0" in _error(
        lambda: OPS.quantize_fp4(x, torch.ones(1), None, "nvfp4")
    )
    assert "center.device=cpu is not allowed: expected cuda:0" in _error(
        lambda: OPS.quantize_fp4(x, torch.ones(1, device="cuda"), torch.zeros(32), "nvfp4")
    )


def test_extension_ships_and_builds_the_fp4_source(kernels):
    src = ops.cuda.source_dir()
    assert_beside_the_imported_package(src)
    assert (src / "fp4_ops.cu").is_file() and "fp4_ops.cu" in ops.cuda.SOURCES
    assert kernels["loaded"] and kernels["sha256"]
    # the CUDA kernel, not the reference, serves CUDA tensors
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fp8state::quantize_fp4", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fp8state::update_centers", "CUDA")
