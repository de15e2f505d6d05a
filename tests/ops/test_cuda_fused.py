"""The fused prologue + FP8 quantize kernels against their references, bit for bit, on the GPU.

LayerNorm + quantize: against the CPU reference (``ops/reference_fused.py`` reproduces the
kernel's reduction order), codes, mean, rstd and the recorded amax. GELU + quantize: against
``F.gelu`` then the quantize reference on the same GPU (torch's GELU is the definition; its
CUDA kernel's erf is what the fused kernel must match), and against our own unfused kernels.
Fresh random data in every case, never zeros.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_fp8state import ops
from lightning_fp8state.ops import reference_fused as ref
from lightning_fp8state.ops.library_fused import layer_norm_max_width
from tests.ops.test_cuda_ops import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"


def rows_of(d: int, dtype, seed: int, rows: int = 67, offset: float = 0.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, d, device="cuda", generator=g) * 3.0 + offset
    x[::7] *= 50.0  # rows of another magnitude
    return x.to(dtype)


def affine(d: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return 1.0 + 0.3 * torch.randn(d, device="cuda", generator=g), 0.2 * torch.randn(d, device="cuda", generator=g)


def widths(dtype) -> list[int]:
    v = 16 // torch.empty((), dtype=dtype).element_size()
    # one chunk; a partial last round of threads; exactly 2 rounds; the 8-round variant; its limit
    return [v, 24 * v, 2 * 256 * v, 2 * 256 * v + v, 3000 // v * v, layer_norm_max_width(dtype)]


def check_layer_norm(x, w, b, eps, scale, dtype, *, record: bool, seed: int):
    pending = torch.rand(4, device="cuda") * 0.01 + 1e-3  # a small earlier record in every cell
    want_pending = pending.cpu().clone()
    if record:
        q, mean, rstd = ops.layer_norm_quantize_fp8(x, w, b, eps, scale, dtype, pending, 2)
    else:
        q, mean, rstd = ops.layer_norm_quantize_fp8(x, w, b, eps, scale, dtype)
    xc, wc, bc = (t.cpu() if t is not None else None for t in (x, w, b))
    rq, rmean, rrstd, ramax = ref.layer_norm_quantize_fp8_reference(xc, wc, bc, eps, scale.cpu(), dtype)
    assert same_bits(q, rq), f"codes differ (seed {seed})"
    assert same_bits(mean, rmean) and same_bits(rstd, rrstd), f"statistics differ (seed {seed})"
    if record:
        want_pending[2] = torch.maximum(want_pending[2], ramax)
    assert same_bits(pending, want_pending), "recorded amax differs (or another slot was touched)"


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_layer_norm_quantize_matches_the_reference_bitwise(dtype, fp8):
    for i, d in enumerate(widths(dtype)):
        seed = 100 * i + d
        x = rows_of(d, dtype, seed, rows=37 if d > 4096 else 67, offset=float(i))
        w, b = affine(d, seed)
        scale = torch.tensor([0.5 + i], device="cuda")
        check_layer_norm(x, w, b, 1e-5, scale, fp8, record=True, seed=seed)
        check_layer_norm(x, w, b, 1e-5, scale, fp8, record=False, seed=seed)


@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_layer_norm_quantize_without_affine_saturating_and_with_nan(dtype):
    d = 768
    x = rows_of(d, dtype, 7)
    x[3, 5] = float("nan")  # one row's statistics and codes become NaN; the amax sticks at NaN
    for w, b in ((None, None), (affine(d, 7)[0], None), (None, affine(d, 7)[1])):
        check_layer_norm(x, w, b, 1e-6, torch.tensor([300.0], device="cuda"), E4M3, record=True, seed=7)
    clean = rows_of(d, dtype, 8)
    check_layer_norm(clean, None, None, 0.0, torch.tensor([1e4], device="cuda"), E5M2, record=True, seed=8)


def test_layer_norm_quantize_takes_views_and_batched_shapes():
    x = rows_of(1024, torch.float32, 9, rows=60).reshape(3, 20, 1024)
    w, b = affine(1024, 9)
    scale = torch.tensor([2.0], device="cuda")
    q, mean, rstd = ops.layer_norm_quantize_fp8(x, w, b, 1e-5, scale, E4M3)
    assert q.shape == x.shape and mean.shape == (3, 20, 1) and rstd.shape == (3, 20, 1)
    check_layer_norm(x, w, b, 1e-5, scale, E4M3, record=True, seed=9)
    wide = rows_of(2048, torch.bfloat16, 10, rows=40)
    view = wide[:, 1024:]  # a strided view: copied to a contiguous buffer first
    check_layer_norm(view, w, b, 1e-5, scale, E4M3, record=True, seed=10)
    shifted = rows_of(1032, torch.float32, 11, rows=8).reshape(-1)[1 : 1 + 8 * 1024].reshape(8, 1024)  # 4-byte offset
    check_layer_norm(shifted, w, b, 1e-5, scale, E4M3, record=True, seed=11)


def test_layer_norm_statistics_close_to_torch():
    x = rows_of(2048, torch.float32, 12, rows=256)
    w, b = affine(2048, 12)
    y, mean, rstd = ref.layer_norm_reference(x, w, b, 1e-5)
    ty, tmean, trstd = torch.ops.aten.native_layer_norm(x, [2048], w, b, 1e-5)
    torch.testing.assert_close(y, ty, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, tmean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd, trstd, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_gelu_quantize_equals_gelu_then_quantize_bitwise(dtype, fp8):
    for n, seed in ((1, 1), (15, 2), (4096 + 7, 3), (2**20 + 5, 4), (3 * 2**20, 5)):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(n, device="cuda", generator=g) * 4.0).to(dtype)
        x[: min(n, 4)] = torch.tensor([-3.0, 0.5, 8.0, -0.0][: min(n, 4)], device="cuda").to(dtype)
        scale = torch.tensor([float(seed) * 7.0], device="cuda")
        y = F.gelu(x)  # torch's CUDA GELU: the definition
        pending = torch.full((3,), 1e-3, device="cuda")
        q = ops.gelu_quantize_fp8(x, scale, fp8, pending, 1)
        assert same_bits(q, ops.quantize_fp8_reference(y, scale, fp8)), f"n={n}"
        assert same_bits(q, ops.quantize_fp8(y, scale, fp8)), f"n={n} (against the unfused kernel)"
        want = torch.maximum(torch.tensor(1e-3, device="cuda"), ops.amax_reference(y))
        assert same_bits(pending[1], want) and same_bits(pending[0], torch.tensor(1e-3, device="cuda"))
        assert same_bits(ops.gelu_quantize_fp8(x, scale, fp8), q)


def test_gelu_quantize_nan_and_views():
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    x[17] = float("nan")
    pending = torch.zeros(1, device="cuda")
    q = ops.gelu_quantize_fp8(x, torch.tensor([2.0], device="cuda"), E4M3, pending, 0)
    assert q.view(torch.uint8)[17].item() == 0x7F
    assert torch.isnan(pending[0])
    big = torch.randn(64, 130, device="cuda")
    view = big[:, 1:129]
    q = ops.gelu_quantize_fp8(view, torch.tensor([3.0], device="cuda"), E4M3)
    assert same_bits(q, ops.quantize_fp8_reference(F.gelu(view), torch.tensor([3.0], device="cuda"), E4M3))


def test_opcheck_and_no_host_sync():
    x = torch.randn(64, 512, device="cuda")
    w, b = affine(512, 1)
    s = torch.tensor([2.0], device="cuda")
    pending = torch.zeros(2, device="cuda")
    torch.library.opcheck(torch.ops.fp8state.gelu_quantize_fp8.default, (x, s, E4M3))
    torch.library.opcheck(torch.ops.fp8state.gelu_quantize_fp8_record_amax.default, (x, s, pending, 1, E4M3))
    torch.library.opcheck(torch.ops.fp8state.layer_norm_quantize_fp8.default, (x, w, b, 1e-5, s, E4M3))
    torch.library.opcheck(
        torch.ops.fp8state.layer_norm_quantize_fp8_record_amax.default, (x, w, b, 1e-5, s, pending, 0, E4M3)
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            ops.gelu_quantize_fp8(x, s, E4M3, pending, 1)
            ops.layer_norm_quantize_fp8(x, w, b, 1e-5, s, E4M3, pending, 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_bad_arguments_name_the_argument():
    x = torch.randn(4, 100, device="cuda")  # 100 % 4 == 0 but try a width that is not
    s = torch.tensor([1.0], device="cuda")
    with pytest.raises(ValueError, match=r"x\.shape\[-1\]"):
        torch.ops.fp8state.layer_norm_quantize_fp8(torch.randn(4, 98, device="cuda"), None, None, 1e-5, s, E4M3)
    with pytest.raises(ValueError, match=r"weight\.shape"):
        torch.ops.fp8state.layer_norm_quantize_fp8(x, torch.ones(99, device="cuda"), None, 1e-5, s, E4M3)
    with pytest.raises(ValueError, match=r"x\.shape\[-1\]"):
        limit = layer_norm_max_width(torch.float32)
        torch.ops.fp8state.layer_norm_quantize_fp8(torch.randn(2, limit + 4, device="cuda"), None, None, 0.0, s, E4M3)
