"""The RMSNorm and SwiGLU prologue kernels and their backward kernels against their CPU
references (``ops/reference_rms.py``, ``ops/reference_swiglu.py``), bit for bit, on the GPU.

Fresh random data in every case, never zeros: rows of several magnitudes, rows holding a NaN,
an infinity or values whose squares overflow, widths of one chunk, of partial warps and rounds,
the widest, the Llama shapes, SwiGLU widths that are not whole 16-byte chunks (the scalar path);
float32, bfloat16 and float16 inputs; both FP8 formats; the recorded amax; views, misaligned
and batched inputs; opcheck, no host synchronization, a CUDA graph; the argument errors give
the CPU's message, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fp8state import ops
from lightning_fp8state.ops import reference_rms as rms_ref
from lightning_fp8state.ops import reference_swiglu as swiglu_ref
from lightning_fp8state.ops.library_fused import layer_norm_max_width
from tests.ops.test_cuda_ops import same_bits
from tests.unit.test_prologue_rms_swiglu import BAD_CALLS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALL = (True, True)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"


def rows_of(d: int, dtype, seed: int, rows: int = 67, specials: bool = True) -> torch.Tensor:
    """Random rows (every 7th 50 times larger); with ``specials``, row 3 holds a NaN, row 4 an
    infinity, row 5 values whose squares overflow float32 (float32 only), row 6 tiny values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, d, device="cuda", generator=g) * 3.0 + 0.25
    x[::7] *= 50.0
    if specials and rows > 6:
        x[3, d // 2] = float("nan")
        x[4, d // 3] = float("inf")
        if dtype == torch.float32:
            x[5] *= 1e19
        x[6] *= 1e-3
    return x.to(dtype)


def weight_of(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return 1.0 + 0.3 * torch.randn(d, device="cuda", generator=g)


def cpu(*tensors):
    return tuple(None if t is None else t.cpu() for t in tensors)


# -- RMSNorm + quantize ---------------------------------------------------------------------


def rms_widths(dtype) -> list[int]:
    v = 16 // torch.empty((), dtype=dtype).element_size()
    # one chunk; a partial last round of threads; exactly 2 rounds; the 8-round variant; the
    # Llama widths; the widest
    return [v, 24 * v, 2 * 256 * v, 2 * 256 * v + v, 3000 // v * v, 2048, 4096, layer_norm_max_width(dtype)]


def check_rms_norm(x, w, eps, scale, fp8, *, record: bool, what: str):
    pending = torch.rand(4, device="cuda") * 0.01 + 1e-3  # a small earlier record in every cell
    want_pending = pending.cpu().clone()
    if record:
        q, rstd = ops.rms_norm_quantize_fp8(x, w, eps, scale, fp8, pending, 2)
    else:
        q, rstd = ops.rms_norm_quantize_fp8(x, w, eps, scale, fp8)
    rq, rrstd, ramax = rms_ref.rms_norm_quantize_fp8_reference(*cpu(x, w), eps, scale.cpu(), fp8)
    assert same_bits(q, rq), f"codes differ {what}"
    assert same_bits(rstd, rrstd), f"rstd differs {what}"
    if record:
        want_pending[2] = torch.maximum(want_pending[2], ramax)
    assert same_bits(pending, want_pending), f"recorded amax differs (or another slot was touched) {what}"


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_rms_norm_quantize_matches_the_reference_bitwise(dtype, fp8):
    for i, d in enumerate(rms_widths(dtype)):
        seed = 100 * i + d
        x = rows_of(d, dtype, seed, rows=37 if d > 4096 else 67)
        w = weight_of(d, seed) if i % 3 != 1 else None
        scale = torch.tensor([0.5 + i], device="cuda")
        what = f"(d={d}, {dtype}, {fp8}, weight={w is not None})"
        check_rms_norm(x, w, 1e-6, scale, fp8, record=True, what=what)
        check_rms_norm(x, w, 1e-5, scale, fp8, record=False, what=what)


@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_rms_norm_quantize_saturating_eps_zero_and_a_clean_record(dtype):
    x = rows_of(768, dtype, 7, specials=False)
    check_rms_norm(x, weight_of(768, 7), 0.0, torch.tensor([300.0], device="cuda"), E4M3, record=True, what="(sat)")
    check_rms_norm(x, None, 1e-6, torch.tensor([1e4], device="cuda"), E5M2, record=True, what="(no NaN)")


def test_rms_norm_quantize_takes_views_and_batched_shapes():
    x = rows_of(1024, torch.float32, 9, rows=60).reshape(3, 20, 1024)
    w, scale = weight_of(1024, 9), torch.tensor([2.0], device="cuda")
    q, rstd = ops.rms_norm_quantize_fp8(x, w, 1e-6, scale, E4M3)
    assert q.shape == x.shape and rstd.shape == (3, 20, 1)
    check_rms_norm(x, w, 1e-6, scale, E4M3, record=True, what="(batched)")
    wide = rows_of(2048, torch.bfloat16, 10, rows=40)
    check_rms_norm(wide[:, 1024:], w, 1e-6, scale, E4M3, record=True, what="(a strided view)")
    shifted = rows_of(1032, torch.float32, 11, rows=8, specials=False).reshape(-1)[1 : 1 + 8 * 1024].reshape(8, 1024)
    check_rms_norm(shifted, w, 1e-6, scale, E4M3, record=True, what="(a 4-byte offset)")
    e = torch.empty(0, 1024, device="cuda")
    q, rstd = ops.rms_norm_quantize_fp8(e, w, 1e-6, scale, E4M3)
    assert q.shape == (0, 1024) and rstd.shape == (0, 1)


# -- RMSNorm backward -----------------------------------------------------------------------


def check_rms_backward(dy, x, rstd, w, mask=ALL, what=""):
    got = ops.rms_norm_backward(dy, x, rstd, w, mask)
    want = rms_ref.rms_norm_backward_reference(*cpu(dy, x, rstd, w), mask)
    for name, g, r in zip(("dx", "dweight"), got, want, strict=True):
        assert (g is None) == (r is None), f"{name} {what}"
        if g is not None:
            assert g.is_cuda and same_bits(g, r), f"{name} differs from the reference {what}"
    return got


def backward_problem(m: int, n: int, dtype, seed: int, specials: bool = False):
    x = rows_of(n, dtype, seed, rows=m, specials=specials)
    _, rstd = rms_ref.rms_norm_reference(x.cpu(), None, 1e-6)
    g = torch.Generator(device="cuda").manual_seed(seed + 7)
    dy = (torch.randn(m, n, device="cuda", generator=g) * 0.1).to(dtype)
    return dy, x, rstd.cuda()


def backward_widths(dtype) -> list[int]:
    v = 16 // torch.empty((), dtype=dtype).element_size()
    # one chunk; a partial warp; the models' 768, 2048 and 4096; one chunk past 512 threads (2
    # rounds); 3 rounds; the widest
    return [v, 9 * v, 768, 2048, 4096, 512 * v + v, 1300 * v, layer_norm_max_width(dtype)]


@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_rms_norm_backward_matches_the_reference_bitwise(dtype):
    for i, n in enumerate(backward_widths(dtype)):
        for m in (1, 67, 1100) if n <= 4096 else (1, 37):
            dy, x, rstd = backward_problem(m, n, dtype, seed=1000 * i + m)
            w = weight_of(n, i) if i % 3 != 1 else None
            check_rms_backward(dy, x, rstd, w, what=f"(m={m}, n={n}, {dtype})")


@pytest.mark.parametrize(
    "m,n,dtype", [(3001, 1024, torch.float32), (8192 + 5, 2048, torch.bfloat16), (4096, 4096, torch.bfloat16)]
)
def test_rms_norm_backward_at_llama_shapes(m, n, dtype):
    dy, x, rstd = backward_problem(m, n, dtype, seed=m)
    check_rms_backward(dy, x, rstd, weight_of(n, 1), what=f"(m={m}, n={n}, {dtype})")


def test_rms_norm_backward_masks_nan_rows_views_and_batched():
    dy, x, rstd = backward_problem(300, 768, torch.float32, seed=7, specials=True)
    w = weight_of(768, 7)
    for mask in ((True, False), (False, True), (False, False)):
        check_rms_backward(dy, x, rstd, w, mask, what=str(mask))
    got = check_rms_backward(dy, x, rstd, w, what="(NaN and infinity rows)")
    assert torch.isnan(got[0][3]).all() and not torch.isnan(got[0][2]).any() and torch.isnan(got[1]).all()
    wide = torch.randn(300, 2 * 768, device="cuda")
    check_rms_backward(wide[:, 768:], x, rstd, w, what="(a strided grad_y)")
    shifted = torch.randn(300 * 768 + 1, device="cuda")[1:].reshape(300, 768)
    check_rms_backward(shifted, x, rstd, w, what="(a misaligned grad_y)")
    check_rms_backward(dy.reshape(3, 100, 768), x.reshape(3, 100, 768), rstd.reshape(3, 100, 1), None, what="(3-D)")
    e = torch.empty(0, 768, device="cuda")
    dx, dw = check_rms_backward(e, e, torch.empty(0, 1, device="cuda"), w, what="(no rows)")
    assert dx.shape == (0, 768) and torch.equal(dw, torch.zeros(768, device="cuda"))


# -- SwiGLU + quantize, and its backward ------------------------------------------------------


SWIGLU_WIDTHS = [1, 3, 4, 7, 8, 15, 16, 100, 1028, 2051, 8192]  # I: whole 16-byte chunks or not


def swiglu_input(rows: int, inter: int, dtype, seed: int) -> torch.Tensor:
    """``h [rows, 2 * inter]`` of several magnitudes; the first rows hold NaN, infinities,
    values past exp's range and tiny values in the gate or the up half."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(rows, 2 * inter, device="cuda", generator=g) * 4.0
    h[::5] *= 30.0
    specials = [float("nan"), float("inf"), -float("inf"), 120.0, -120.0, 1e-30, -88.5, 0.0, -0.0]
    for r, v in enumerate(specials[: min(rows, len(specials))]):
        h[r, r % inter] = v  # the gate
        h[r, inter + (r + 1) % inter] = -v  # the up half
    return h.to(dtype)


def check_swiglu(h, scale, fp8, what: str):
    pending = torch.rand(3, device="cuda") * 0.01 + 1e-3
    want_pending = pending.cpu().clone()
    q = ops.swiglu_quantize_fp8(h, scale, fp8, pending, 1)
    rq, ramax = swiglu_ref.swiglu_quantize_fp8_reference(h.cpu(), scale.cpu(), fp8)
    assert same_bits(q, rq), f"codes differ {what}"
    want_pending[1] = torch.maximum(want_pending[1], ramax)
    assert same_bits(pending, want_pending), f"recorded amax differs {what}"
    assert same_bits(ops.swiglu_quantize_fp8(h, scale, fp8), q), f"the plain op's codes differ {what}"


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_swiglu_quantize_matches_the_reference_bitwise(dtype, fp8):
    for i, inter in enumerate(SWIGLU_WIDTHS):
        h = swiglu_input(67 if inter < 4096 else 9, inter, dtype, seed=10 * i + inter)
        check_swiglu(h, torch.tensor([0.25 + 3 * i], device="cuda"), fp8, f"(I={inter}, {dtype}, {fp8})")


@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_swiglu_backward_matches_the_reference_bitwise(dtype):
    for i, inter in enumerate(SWIGLU_WIDTHS):
        rows = 67 if inter < 4096 else 9
        h = swiglu_input(rows, inter, dtype, seed=20 * i + inter)
        g = torch.Generator(device="cuda").manual_seed(i)
        dy = torch.randn(rows, inter, device="cuda", generator=g).to(dtype)
        got = ops.swiglu_backward(dy, h)
        assert got.shape == h.shape and got.dtype == dtype
        assert same_bits(got, swiglu_ref.swiglu_backward_reference(dy.cpu(), h.cpu())), f"(I={inter}, {dtype})"


@pytest.mark.parametrize("inter", [8192, 14336])
def test_swiglu_at_llama_shapes(inter):
    h = swiglu_input(64, inter, torch.bfloat16, seed=inter)
    check_swiglu(h, torch.tensor([8.0], device="cuda"), E4M3, f"(I={inter})")
    dy = torch.randn(64, inter, device="cuda").bfloat16()
    assert same_bits(ops.swiglu_backward(dy, h), swiglu_ref.swiglu_backward_reference(dy.cpu(), h.cpu()))


def test_swiglu_views_misaligned_batched_and_empty():
    scale = torch.tensor([2.0], device="cuda")
    h = swiglu_input(60, 256, torch.bfloat16, seed=1).reshape(3, 20, 512)
    q = ops.swiglu_quantize_fp8(h, scale, E4M3)
    assert q.shape == (3, 20, 256)
    check_swiglu(h, scale, E4M3, "(batched)")
    big = swiglu_input(40, 300, torch.float32, seed=2)
    check_swiglu(big[:, 1:513], scale, E4M3, "(a strided view)")
    flat = swiglu_input(9, 64, torch.float32, seed=3).reshape(-1)
    check_swiglu(flat[1 : 1 + 8 * 128].reshape(8, 128), scale, E4M3, "(a 4-byte offset)")
    dy = torch.randn(3, 20, 256, device="cuda").bfloat16()
    assert same_bits(ops.swiglu_backward(dy, h), swiglu_ref.swiglu_backward_reference(dy.cpu(), h.cpu()))
    wide = torch.randn(3, 20, 512, device="cuda").bfloat16()
    assert same_bits(
        ops.swiglu_backward(wide[..., ::2], h), swiglu_ref.swiglu_backward_reference(wide[..., ::2].cpu(), h.cpu())
    )
    e = torch.empty(0, 512, device="cuda")
    assert ops.swiglu_quantize_fp8(e, scale, E4M3).shape == (0, 256)
    assert ops.swiglu_backward(torch.empty(0, 256, device="cuda"), e).shape == (0, 512)


# -- opcheck, host synchronization, CUDA graphs, messages ---------------------------------------


def test_opcheck_and_no_host_sync():
    x, w, s = (
        rows_of(512, torch.float32, 1, rows=64, specials=False),
        weight_of(512, 1),
        torch.tensor([2.0], device="cuda"),
    )
    pending = torch.zeros(2, device="cuda")
    h, gy = (
        torch.randn(64, 200, device="cuda") * 3,
        torch.randn(64, 100, device="cuda"),
    )  # (no NaN: opcheck compares values)
    _, rstd = ops.rms_norm_quantize_fp8(x, w, 1e-6, s, E4M3)
    fp8state = torch.ops.fp8state
    torch.library.opcheck(fp8state.rms_norm_quantize_fp8.default, (x, w, 1e-6, s, E4M3))
    torch.library.opcheck(fp8state.rms_norm_quantize_fp8_record_amax.default, (x, None, 1e-6, s, pending, 1, E4M3))
    torch.library.opcheck(fp8state.rms_norm_backward.default, (x, x, rstd, w, [True, True]))
    torch.library.opcheck(fp8state.swiglu_quantize_fp8.default, (h, s, E5M2))
    torch.library.opcheck(fp8state.swiglu_quantize_fp8_record_amax.default, (h, s, pending, 0, E4M3))
    torch.library.opcheck(fp8state.swiglu_backward.default, (gy, h))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            ops.rms_norm_quantize_fp8(x, w, 1e-6, s, E4M3, pending, 0)
            ops.rms_norm_backward(x, x, rstd, w, ALL)
            ops.swiglu_quantize_fp8(h, s, E4M3, pending, 1)
            ops.swiglu_backward(gy, h)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_kernels_in_a_cuda_graph():
    x, w, s = (
        rows_of(768, torch.bfloat16, 5, rows=256, specials=False),
        weight_of(768, 5),
        torch.tensor([2.0], device="cuda"),
    )
    h, gy = swiglu_input(256, 384, torch.bfloat16, seed=5), torch.randn(256, 384, device="cuda").bfloat16()
    pending = torch.zeros(2, device="cuda")
    _, rstd = ops.rms_norm_quantize_fp8(x, w, 1e-6, s, E4M3)

    def step():
        q, r = ops.rms_norm_quantize_fp8(x, w, 1e-6, s, E4M3, pending, 0)
        return (
            q,
            r,
            *ops.rms_norm_backward(x, x, rstd, w, ALL),
            ops.swiglu_quantize_fp8(h, s, E4M3, pending, 1),
            ops.swiglu_backward(gy, h),
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (6, 7):  # fresh data into the captured inputs, then replay
        x.copy_(rows_of(768, torch.bfloat16, seed, rows=256, specials=False))
        h.copy_(swiglu_input(256, 384, torch.bfloat16, seed=seed))
        graph.replay()
        for g, e in zip(out, step(), strict=True):
            assert same_bits(g, e)


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_the_cpu_message(name):
    call, message = BAD_CALLS[name]
    with pytest.raises(ValueError) as info:
        call(lambda *shape: torch.ones(*shape, device="cuda"))
    assert str(info.value) == message
