"""The CUDA kernels against the pure-torch reference, bit for bit, on the GPU.

Skipped with a reason where there is no CUDA device. On a CUDA machine the kernels MUST
build and load: a failed build fails these tests instead of silently testing the fallback.
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state import ops
from tests.ops.kernel_data import assert_beside_the_imported_package, put_negative_nan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 15, 17, 4096, 2**20 + 3]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"
    return ops.cuda.extension_info()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def edge_values(dtype: torch.dtype, fmt) -> torch.Tensor:
    fi = torch.finfo(dtype)
    vals = [
        0.0,
        -0.0,
        fi.tiny,
        -fi.tiny,
        fi.tiny / 4,
        fi.max,
        -fi.max,
        float("inf"),
        float("-inf"),
        float("nan"),
        fmt.max,
        -fmt.max,
        fmt.max * 1.0625,
        fmt.max * 2,
        fmt.min_subnormal,
        fmt.min_subnormal / 2,
        fmt.min_subnormal * 1.5,
        fmt.min_normal,
        1.0,
        -1.0,
        0.5,
        0.0,  # replaced below by a negative NaN (its bits: arithmetic may not keep the sign)
    ]
    t = torch.tensor(vals, dtype=torch.float32).to(dtype)
    put_negative_nan(t, len(vals) - 1)
    return t


def fresh(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    mag = torch.exp(torch.randn(n, device="cuda", generator=g) * 4)  # many decades
    sign = torch.where(torch.rand(n, device="cuda", generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(dtype)


@pytest.mark.parametrize("fmt", [f8s.E4M3, f8s.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_quantize_and_record_match_reference_bitwise(fmt, dtype, n):
    x = fresh(n, dtype, seed=n)
    edges = edge_values(dtype, fmt).cuda()
    x[: min(n, edges.numel())] = edges[: min(n, edges.numel())]
    for scale_value in (1.0, 0.37109375, 1234.5):
        scale = torch.tensor([scale_value], device="cuda")
        pending = torch.rand(4, device="cuda") * 1e-3
        pending_ref = pending.cpu().clone()
        q = ops.quantize_fp8_record_amax(x, scale, pending, 2, fmt.dtype)
        q_ref = ops.quantize_fp8_reference(x.cpu(), scale.cpu(), fmt.dtype)
        assert same_bits(q, q_ref), (fmt.name, dtype, n, scale_value)
        cell = pending_ref[2:3]
        cell.copy_(ops.reference.canonical_nan(torch.maximum(cell, ops.amax_reference(x.cpu()).reshape(1))))
        assert same_bits(pending, pending_ref)
        assert same_bits(ops.quantize_fp8(x, scale, fmt.dtype), q_ref)


@pytest.mark.parametrize("fmt", [f8s.E4M3, f8s.E5M2], ids=["e4m3", "e5m2"])
def test_non_contiguous_and_misaligned_views(fmt):
    base = fresh(64 * 130, torch.bfloat16, seed=7).reshape(64, 130)
    scale = torch.tensor([3.0], device="cuda")
    for view in (base[:, ::2], base.t(), base[1:, 3:], base.reshape(-1)[1:], base[:, 1:17]):
        pending = torch.zeros(1, device="cuda")
        q = ops.quantize_fp8_record_amax(view, scale, pending, 0, fmt.dtype)
        assert q.is_contiguous()
        assert same_bits(q, ops.quantize_fp8_reference(view.cpu(), scale.cpu(), fmt.dtype))
        assert same_bits(pending, view.float().abs().max().reshape(1))


@pytest.mark.parametrize("fmt", [f8s.E4M3, f8s.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_matches_reference_bitwise(fmt, out_dtype, n):
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    codes[: min(n, 256)] = torch.arange(min(n, 256), dtype=torch.uint8, device="cuda")  # every code
    q = codes.view(fmt.dtype)
    for descale_value in (1.0, 2.0**-7, 0.0123, 3.0e38):
        descale = torch.tensor([descale_value], device="cuda")
        out = ops.dequantize_fp8(q, descale, out_dtype)
        ref = ops.dequantize_fp8_reference(q.cpu(), descale.cpu(), out_dtype)
        assert same_bits(out, ref), (fmt.name, out_dtype, n, descale_value)
    strided = q[::3]
    assert same_bits(
        ops.dequantize_fp8(strided, descale, out_dtype),
        ops.dequantize_fp8_reference(strided.cpu(), descale.cpu(), out_dtype),
    )


def random_bank(H: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hist = torch.rand(H, n, generator=g) * torch.exp(torch.randn(1, n, generator=g) * 3)
    hist[:, : n // 8] = 0.0  # owners with no history yet
    scale = torch.rand(n, generator=g) * 100 + 0.01
    descale = 1 / scale
    pending = torch.rand(n, generator=g) * 10
    specials = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 3e38, float("-inf")])
    pending[: min(n, 6)] = specials[: min(n, 6)]
    count = torch.randint(0, 5, (n,), generator=g, dtype=torch.int32)
    mask = torch.rand(n, generator=g) < 0.7
    fmax = torch.where(torch.rand(n, generator=g) < 0.5, 448.0, 57344.0)
    return [hist, scale, descale, pending, count, mask, fmax]


@pytest.mark.parametrize("n", [1, 64, 1024, 5000])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
def test_update_scales_matches_reference_bitwise(n, algo, margin):
    cpu = random_bank(16, n, seed=n + margin)
    gpu = [t.cuda() for t in cpu]
    ops.update_scales_reference(*cpu, algo, margin)
    ops.update_scales(*gpu, algo, margin)
    for name, a, b in zip(["history", "scale", "descale", "pending", "count", "mask", "fmax"], gpu, cpu, strict=True):
        assert same_bits(a, b), name


def test_kernel_input_checks_name_the_argument():
    x = torch.randn(8, device="cuda")
    with pytest.raises(ValueError, match=r"scale.dtype=.* is not allowed: expected torch.float32"):
        ops.quantize_fp8(x, torch.ones(1, device="cuda", dtype=torch.float64), E4M3)
    with pytest.raises(ValueError, match=r"scale.device"):
        ops.quantize_fp8(x, torch.ones(1), E4M3)
    for slot in (2, -1):
        with pytest.raises(ValueError, match=r"slot=.* is not allowed: expected 0 <= slot < 2"):
            ops.quantize_fp8_record_amax(x, torch.ones(1, device="cuda"), torch.zeros(2, device="cuda"), slot, E4M3)
    with pytest.raises(ValueError, match=r"x.dtype"):
        ops.quantize_fp8(x.int(), torch.ones(1, device="cuda"), E4M3)


def test_opcheck_every_op_on_cuda():
    x = fresh(256, torch.bfloat16, seed=3)
    s = torch.tensor([2.0], device="cuda")
    q = ops.quantize_fp8(x, s, E4M3)
    torch.library.opcheck(torch.ops.fp8state.quantize_fp8.default, (x, s, E4M3))
    torch.library.opcheck(
        torch.ops.fp8state.quantize_fp8_record_amax.default, (x, s, torch.rand(3, device="cuda"), 1, E5M2)
    )
    # test_schema compares with allclose, which has no float8 kernel: run the others
    torch.library.opcheck(
        torch.ops.fp8state.dequantize_fp8.default,
        (q, s, torch.float32),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )
    bank = [t.cuda() for t in random_bank(4, 32, seed=1)]
    torch.library.opcheck(torch.ops.fp8state.update_scales.default, (*bank, "max", 1))


def test_torch_compile_fullgraph_uses_the_ops():
    def f(x, scale, pending, descale):
        q = torch.ops.fp8state.quantize_fp8_record_amax(x, scale, pending, 0, E4M3)
        return torch.ops.fp8state.dequantize_fp8(q, descale, torch.bfloat16) * 2

    compiled = torch.compile(f, fullgraph=True)
    x = fresh(4096, torch.bfloat16, seed=11)
    s = torch.tensor([0.5], device="cuda")
    p_eager, p_comp = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    eager = f(x, s, p_eager, 1 / s)
    out = compiled(x, s, p_comp, 1 / s)
    assert same_bits(out, eager)
    assert same_bits(p_comp, p_eager)


def test_no_host_sync_in_any_op():
    x = fresh(1 << 16, torch.bfloat16, seed=5)
    s = torch.tensor([2.0], device="cuda")
    pending = torch.zeros(8, device="cuda")
    bank = [t.cuda() for t in random_bank(16, 64, seed=2)]
    q = ops.quantize_fp8(x, s, E4M3)  # warm-up (and lazy load) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q = ops.quantize_fp8_record_amax(x, s, pending, 3, E4M3)
        ops.quantize_fp8(x, s, E5M2)
        ops.dequantize_fp8(q, s, torch.bfloat16)
        ops.update_scales(*bank, "max", 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_extension_is_built_from_the_imported_package(kernels):
    """Run from a plain (non-editable) install, this proves the sources ship and build there; run from a
    source checkout, that the checkout's own csrc/ is built."""
    src = ops.cuda.source_dir()
    assert_beside_the_imported_package(src)
    assert all((src / s).is_file() for s in ops.cuda.SOURCES)
    assert all((src / h).is_file() for h in ops.cuda.HEADERS)  # the shared header ships too
    assert kernels["loaded"] and kernels["sha256"]
    # built from these very files: the library sits in the directory named by their hash
    assert kernels["source_hash"] == ops.cuda.source_hash()
    assert __import__("pathlib").Path(kernels["library"]).parent.name == ops.cuda.build_tag()
    # a child process loaded this build first and recorded it (ops/cuda.py:load_check)
    marker = ops.cuda.load_check()
    assert marker.is_file() and marker.parent == __import__("pathlib").Path(kernels["library"]).parent


def random_codes(shape, dtype, seed: int) -> torch.Tensor:
    """Every byte value (NaN codes included) at random: the transpose must move them all."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, device="cuda", dtype=torch.uint8).view(dtype)


# full 128-tiles only; tiles plus right / bottom strips; not multiples of 16 (simple kernel);
# degenerate rows and columns; the GEMM shapes of the benchmarks
TRANSPOSE_SHAPES = [(128, 128), (384, 256), (8192 + 16, 4096 + 48), (130, 4096), (17, 15), (1, 1), (1, 4096), (4096, 1)]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES, ids=str)
def test_transpose_matches_reference_bitwise(dtype, shape):
    q = random_codes(shape, dtype, seed=sum(shape))
    out = ops.transpose_fp8(q)
    assert out.is_contiguous() and out.shape == (shape[1], shape[0])
    assert same_bits(out, ops.transpose_fp8_reference(q))
    assert same_bits(out, q.cpu().t().contiguous())


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_transpose_of_views(dtype):
    base = random_codes((512, 1024 + 16), dtype, seed=7)
    for view in (
        base[:, 16:],  # contiguous rows, not contiguous overall
        base.reshape(-1)[1 : 1 + 256 * 512].view(256, 512),  # 1-byte offset: not 16-byte aligned
        base[:256, :512].t(),  # already a transposed view
        base[::2, :512],  # strided rows
    ):
        assert same_bits(ops.transpose_fp8(view), ops.transpose_fp8_reference(view))


def test_transpose_checks_and_opcheck():
    with pytest.raises(ValueError, match=r"q.dtype=.* is not allowed: expected one of"):
        ops.transpose_fp8(torch.zeros(4, 4, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"q.dim\(\)=.* is not allowed: expected 2"):
        ops.transpose_fp8(random_codes((4, 4, 4), E4M3, seed=1))
    # test_schema compares with allclose, which has no float8 kernel: run the others, on
    # finite codes (the comparisons treat NaN as unequal)
    finite = ops.quantize_fp8(
        fresh(256 * 384, torch.bfloat16, seed=2).view(256, 384), torch.tensor([1.0], device="cuda"), E4M3
    )
    torch.library.opcheck(
        torch.ops.fp8state.transpose_fp8.default,
        (finite,),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )
    q = random_codes((1024, 2048), E5M2, seed=3)
    ops.transpose_fp8(q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.transpose_fp8(q)
    finally:
        torch.cuda.set_sync_debug_mode(0)
