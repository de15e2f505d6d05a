"""The FP4 CUDA kernels' source run on the host (tests/ops/fp4_emulate.cpp: one std::thread per
CUDA thread, emulated barriers, shuffles and atomics), bit for bit against the reference.

This checks what a CPU can check of csrc/fp4_ops.cu without a GPU: the kernels' indexing,
tiling, row groups, warp-pair shuffles, CTA reductions, the CAS folds of the center statistics,
the slow (NaN) paths and every float32 rule, run through the real launch plans (with a small
resident-CTA count so that small inputs use several row groups). The device's own arithmetic
is checked by test_cuda_fp4.py on a GPU. Needs g++ (C++20) and the CUDA headers; skipped with a
reason where they are missing.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from lightning_fp8state.ops.cuda import source_dir
from tests.ops.kernel_data import FULL_RANGE_SCALES, full_range, put_negative_nan, subnormal_tie_block

OPS = torch.ops.fp8state
SRC = Path(__file__).with_name("fp4_emulate.cpp")
LAYOUTS = ["nvfp4", "mxfp4"]
BLOCK = {"nvfp4": 16, "mxfp4": 32}
SCALE_DTYPE = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.float8_e8m0fnu}
FMAX = {"nvfp4": 2688.0, "mxfp4": 6.0}
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).resolve().parent.parent / "include"] if nvcc else []
    candidates += [Path("/usr/local/cuda/include")]
    for c in candidates:
        if (c / "cuda_bf16.h").is_file():
            return c
    return None


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    include = _cuda_include()
    if shutil.which("g++") is None or include is None:
        pytest.skip("needs g++ and the CUDA headers (cuda_bf16.h) to build the host emulation")
    exe = tmp_path_factory.mktemp("fp4emu") / "fp4_emulate"
    cmd = [
        "g++",
        "-std=c++20",
        "-O2",
        "-pthread",
        "-ffp-contract=off",
        # The kernels reinterpret 16-byte words as bf16x2 / half2 / uint32 lanes (the CUDA idiom);
        # g++ -O2 otherwise reorders such accesses under strict aliasing.
        "-fno-strict-aliasing",
        f"-I{include}",
        f"-I{source_dir()}",
        "-o",
        str(exe),
        str(SRC),
    ]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    return exe


def _run(exe, args, cwd: Path):
    run = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"emulator failed ({run.returncode}): {run.stderr[-2000:]}"


def _write(path: Path, t: torch.Tensor) -> None:
    path.write_bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _read(path: Path, dtype: torch.dtype, shape) -> torch.Tensor:
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    return data.view(dtype).reshape(shape).clone()


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got, want, what):
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (what, got.dtype, want.dtype)
    if torch.equal(raw(got), raw(want)):
        return
    width = got.element_size()
    bad = sorted({int(i) // width for i in (raw(got) != raw(want)).nonzero().reshape(-1).tolist()})
    g, w = got.reshape(-1), want.reshape(-1)
    lines = [f"{what}: {len(bad)} elements differ of {got.numel()}"]
    for e in bad[:4]:
        lines.append(f"  element {e}: got {raw(g[e : e + 1]).tolist()} want {raw(w[e : e + 1]).tolist()}")
    raise AssertionError("\n".join(lines))


def emulate_quantize(exe, tmp: Path, x, scale, layout, center=None, pending=None, slot=0, stats=None, resident=3):
    k = x.shape[-1]
    rows = x.numel() // k
    _write(tmp / "x.bin", x)
    _write(tmp / "scale.bin", scale)
    if center is not None:
        _write(tmp / "center.bin", center)
    if pending is not None:
        _write(tmp / "pending.bin", pending)
    row_off = cstride = 0
    if stats is not None:
        cmax, cmin = stats
        _write(tmp / "cmax.bin", cmax)
        _write(tmp / "cmin.bin", cmin)
        row_off, cstride = slot * cmax.shape[1], 1
    args = ["quantize", TYPE_CODE[x.dtype], int(layout == "mxfp4"), rows, k, int(center is not None)]
    args += [int(pending is not None), int(stats is not None), slot, cstride, row_off, resident, tmp]
    _run(exe, args, tmp)
    block = BLOCK[layout]
    packed = _read(tmp / "packed.out", torch.uint8, (*x.shape[:-1], k // 2))
    scales = _read(tmp / "scales.out", torch.uint8, (*x.shape[:-1], k // block)).view(SCALE_DTYPE[layout])
    if pending is not None:
        pending.copy_(_read(tmp / "pending.out", torch.float32, pending.shape))
    if stats is not None:
        stats[0].copy_(_read(tmp / "cmax.out", torch.float32, stats[0].shape))
        stats[1].copy_(_read(tmp / "cmin.out", torch.float32, stats[1].shape))
    return packed, scales


def fresh(shape, dtype, seed, decades=3.0):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(shape, generator=g) * decades)
    rows = torch.randint(-12, 13, (*shape[:-1], 1), generator=g).float()
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    lim = torch.finfo(dtype).max / 4
    return (mag * torch.exp2(rows) * sign).clamp(-lim, lim).to(dtype)


def with_edges(x, layout):
    x = x.clone()
    flat = x.reshape(-1)
    b = BLOCK[layout]
    fi = torch.finfo(x.dtype)
    edges = [0.0, -0.0, fi.tiny, -fi.tiny, fi.tiny / 4, fi.max, -fi.max, math.inf, -math.inf, math.nan, 6.0, -6.0, 5.0]
    edges += [448.0, 2688.0, 4032.0, 0.25, 0.75, 7.99, 8.0]
    e = torch.tensor(edges, dtype=torch.float32).to(x.dtype)
    n_blocks = flat.numel() // b
    plans = [
        lambda blk: blk[: min(b, e.numel())].copy_(e[: min(b, e.numel())]),
        lambda blk: blk.__setitem__(b // 2, math.inf),
        lambda blk: blk.copy_(torch.where(torch.arange(b) % 2 == 0, 0.0, -0.0).to(x.dtype)),
        lambda blk: blk.fill_(fi.tiny / 8),
        lambda blk: blk.__setitem__(0, 2688.0 * 4),
        lambda blk: blk.__setitem__(1, math.nan),
        lambda blk: blk.fill_(-6.0),
        lambda blk: put_negative_nan(blk, 3),
    ]
    for i, plan in enumerate(plans):
        if 2 * i + 1 < n_blocks:
            plan(flat[(2 * i + 1) * b : (2 * i + 2) * b])
    return x


def stats_rows(owners, width, seed):
    g = torch.Generator().manual_seed(seed)
    cmax = torch.full((owners, width), -math.inf)
    cmin = torch.full((owners, width), math.inf)
    pick = torch.rand(owners, width, generator=g) < 0.3
    vals = torch.randn(owners, width, generator=g) * 10
    cmax, cmin = torch.where(pick, vals, cmax), torch.where(pick, vals - 1, cmin)
    if width >= 4:
        cmax[:, 0], cmin[:, 0] = 0.0, 0.0
        cmax[:, 1], cmin[:, 1] = -0.0, -0.0
        cmax[:, 2], cmin[:, 2] = math.nan, 5.0
    return cmax, cmin


def check_all_quantize_ops(exe, tmp, x, s, layout, center, resident, tag):
    scale = torch.tensor([s], dtype=torch.float32)
    tag = f"{tag} {layout} {x.dtype} {tuple(x.shape)} S={s!r} resident={resident}"
    for c in (None, center):
        got = emulate_quantize(exe, tmp, x, scale, layout, center=c, resident=resident)
        want = OPS.quantize_fp4(x, scale, c, layout)
        assert_same(got[0], want[0], f"packed, center={c is not None} [{tag}]")
        assert_same(got[1], want[1], f"block scales, center={c is not None} [{tag}]")
    pending = torch.rand(4) * 1e-3
    p_ref = pending.clone()
    got = emulate_quantize(exe, tmp, x, scale, layout, pending=pending, slot=2, resident=resident)
    want = OPS.quantize_fp4_record_amax(x, scale, p_ref, 2, layout)
    assert_same(got[0], want[0], f"record packed [{tag}]")
    assert_same(pending, p_ref, f"record pending [{tag}]")
    k = x.shape[-1]
    pending = torch.rand(3) * 1e-3
    stats = stats_rows(3, k + 5, 1)
    p_ref, s_ref = pending.clone(), tuple(t.clone() for t in stats)
    got = emulate_quantize(exe, tmp, x, scale, layout, center, pending, 1, stats, resident)
    want = OPS.quantize_fp4_centered_record(x, scale, center, p_ref, *s_ref, 1, layout)
    assert_same(got[0], want[0], f"centered record packed [{tag}]")
    assert_same(got[1], want[1], f"centered record block scales [{tag}]")
    assert_same(pending, p_ref, f"centered record pending [{tag}]")
    assert_same(stats[0], s_ref[0], f"centered record center_max [{tag}]")
    assert_same(stats[1], s_ref[1], f"centered record center_min [{tag}]")


SHAPES = {
    "nvfp4": [(1, 16), (3, 64), (1200, 64), (600, 16), (2, 4096)],
    "mxfp4": [(1, 32), (3, 64), (1200, 64), (2, 4096)],
}
CASES = [(lay, shape) for lay in LAYOUTS for shape in SHAPES[lay]]


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize(("layout", "shape"), CASES, ids=[f"{lay}-{s[0]}x{s[1]}" for lay, s in CASES])
def test_emulated_quantize_ops_match_reference(emulator, tmp_path, layout, shape, dtype):
    seed = zlib.crc32(f"{layout}{shape}{dtype}".encode())
    x = with_edges(fresh(shape, dtype, seed), layout)
    g = torch.Generator().manual_seed(seed)
    center = torch.randn(shape[-1], generator=g) * 4
    finite = x.float().abs()[torch.isfinite(x.float())]
    tensor_scale = FMAX[layout] / float(finite.max())
    for s in (1.0, tensor_scale):
        check_all_quantize_ops(emulator, tmp_path, x, s, layout, center, 3, "fresh+edges")
    check_all_quantize_ops(
        emulator, tmp_path, fresh(shape, dtype, seed + 1), tensor_scale, layout, center, 1000, "fresh"
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_special_scales_and_centers(emulator, tmp_path, layout):
    x = with_edges(fresh((7, 64), torch.bfloat16, 5), layout)
    center = torch.randn(64) * 3
    center[:8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 3e38, -3e38])
    for s in (0.0, -0.0, -1.5, math.inf, -math.inf, math.nan, 2.0**-149, 1e-38, 3e38, 2688.0, 6.0):
        check_all_quantize_ops(emulator, tmp_path, x, s, layout, center, 3, "special S")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_full_exponent_range(emulator, tmp_path, layout, dtype):
    """Blocks from every binade (subnormals included) under tiny to huge tensor scales."""
    x = full_range((24, 64), dtype, 17, "cpu")
    center = torch.randn(64) * 3
    for s in FULL_RANGE_SCALES:
        check_all_quantize_ops(emulator, tmp_path, x, s, layout, center, 3, "full range")


def test_emulated_mxfp4_subnormal_product_on_a_tie(emulator, tmp_path):
    x, s = subnormal_tie_block()
    packed, _ = OPS.quantize_fp4(x, torch.tensor([s]), None, "mxfp4")
    assert int(packed[0, 0]) == 0x80  # codes 0 and -0: the tie rounded twice, as the rule says
    check_all_quantize_ops(emulator, tmp_path, x, s, "mxfp4", torch.zeros(32), 3, "subnormal tie")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_emulated_center_statistics_contention(emulator, tmp_path, dtype):
    """3000 rows of 16 channels: 12 row groups fold the same channels (CAS loop); +-0, a
    NaN of each sign and the type's extremes in single channels (16-bit statistics keys)."""
    x = fresh((3000, 16), dtype, 2)
    x[1500, 3] = math.nan
    x.view(torch.int16)[10, 4] = {torch.bfloat16: -64, torch.float16: -512}[dtype]  # negative NaN
    x[700, 7] = torch.finfo(dtype).max
    x[900, 8] = -torch.finfo(dtype).max
    x[:, 5] = -0.0
    x[:1500, 6] = 0.0
    x[1500:, 6] = -0.0
    check_all_quantize_ops(emulator, tmp_path, x, 0.5, "nvfp4", torch.randn(16), 12, "contention")


def emulate_dequantize(exe, tmp, packed, scales, descale, layout, dtype, center=None, resident=3):
    k = 2 * packed.shape[-1]
    rows = packed.numel() * 2 // k
    _write(tmp / "packed.bin", packed)
    _write(tmp / "scales.bin", scales)
    _write(tmp / "descale.bin", descale)
    if center is not None:
        _write(tmp / "center.bin", center)
    args = ["dequantize", TYPE_CODE[dtype], int(layout == "mxfp4"), rows, k, int(center is not None), resident, tmp]
    _run(exe, args, tmp)
    return _read(tmp / "out.out", dtype, (*packed.shape[:-1], k))


@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_dequantize_every_byte_and_code(emulator, tmp_path, layout, out_dtype):
    b = BLOCK[layout]
    k = 256 * b
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (2, k // 2), dtype=torch.uint8, generator=g)
    packed[0, :256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2, 1).view(SCALE_DTYPE[layout])
    center = torch.randn(k, generator=g) * 4
    center[:6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3e38])
    for d in (1.0, 2.0**-7, 0.0123, 3e38, 0.0, -2.5, math.inf, math.nan, 2.0**-140):
        descale = torch.tensor([d], dtype=torch.float32)
        for c in (None, center):
            got = emulate_dequantize(emulator, tmp_path, packed, scales, descale, layout, out_dtype, c)
            want = OPS.dequantize_fp4(packed, scales, descale, c, layout, out_dtype)
            assert_same(got, want, f"dequantize {layout} -> {out_dtype} descale={d!r} center={c is not None}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_dequantize_of_quantized_rows(emulator, tmp_path, layout):
    for shape in ((1200, 64), (3, 4096), (1, BLOCK[layout])):
        x = with_edges(fresh(shape, torch.bfloat16, 3), layout)
        packed, scales = OPS.quantize_fp4(x, torch.tensor([0.75]), None, layout)
        center = torch.randn(shape[-1])
        for dtype in IN_DTYPES:
            for c in (None, center):
                got = emulate_dequantize(emulator, tmp_path, packed, scales, torch.tensor([1.5]), layout, dtype, c)
                want = OPS.dequantize_fp4(packed, scales, torch.tensor([1.5]), c, layout, dtype)
                assert_same(got, want, f"dequantize {layout} {shape} -> {dtype} center={c is not None}")


def test_emulated_update_centers(emulator, tmp_path):
    g = torch.Generator().manual_seed(4)
    for n, c in ((1, 1), (64, 16), (300, 200)):
        center = torch.randn(n, c, generator=g) * 5
        cmax = center + torch.rand(n, c, generator=g) * 3
        cmin = center - torch.rand(n, c, generator=g) * 3
        fresh_rows = torch.rand(n, c, generator=g) < 0.2
        cmax, cmin = torch.where(fresh_rows, -math.inf, cmax), torch.where(fresh_rows, math.inf, cmin)
        for i, v in enumerate([math.nan, math.inf, -math.inf, 0.0, -0.0, 3e38, -3e38, 1e-45]):
            if i < c:
                cmax[i % n, i] = v
                cmin[(i + 1) % n, i] = v
        if c > 9:
            center[0, 8] = math.nan
            cmax[0, 8], cmin[0, 8] = 1.0, -1.0
        mask = torch.rand(n, generator=g) < 0.7
        for momentum in (1.0, 0.5, 0.1, 1e-3):
            bank = [t.clone() for t in (center, cmax, cmin)]
            for name, t in zip(("center", "cmax", "cmin"), bank, strict=True):
                _write(tmp_path / f"{name}.bin", t)
            _write(tmp_path / "mask.bin", mask)
            m_bits = int(torch.tensor(momentum, dtype=torch.float32).view(torch.int32))
            _run(emulator, ["centers", n, c, f"{m_bits & 0xFFFFFFFF:x}", tmp_path], tmp_path)
            ref = [t.clone() for t in bank]
            OPS.update_centers(*ref, mask, momentum)
            for name, want in zip(("center", "cmax", "cmin"), ref, strict=True):
                got = _read(tmp_path / f"{name}.out", torch.float32, (n, c))
                assert_same(got, want, f"update_centers {name} n={n} c={c} momentum={momentum}")
