"""The LayerNorm backward op (``fp8state::layer_norm_backward``): reference and CUDA kernel.

CPU: the vectorized reference against a scalar walk of the kernel's algorithm (thread by
thread, bit for bit), against float64 math (within float32 rounding), the argument checks
and opcheck. GPU (skipped without CUDA): the kernel against the CPU reference bit for bit on
fresh random data, in a CUDA graph, and without host synchronization.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fp8state import ops
from lightning_fp8state.ops import reference_fused as ref_fwd
from lightning_fp8state.ops import reference_ln as ref
from lightning_fp8state.ops.library_fused import layer_norm_max_width
from tests.ops.test_cuda_ops import same_bits

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)")
ALL = (True, True, True)


def problem(m: int, n: int, dtype, seed: int, device="cpu", affine: bool = True):
    """``(dy, x, mean, rstd, weight)``: x with rows of several magnitudes, its statistics from the
    fused forward's reference, a weight around 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, n, generator=g, device=device) * 3.0 + 0.5
    x[::5] *= 40.0
    dy = torch.randn(m, n, generator=g, device=device) * 0.1
    w = (1.0 + 0.3 * torch.randn(n, generator=g, device=device)) if affine else None
    x, dy = x.to(dtype), dy.to(dtype)
    _, mean, rstd = ref_fwd.layer_norm_reference(x.cpu(), None, None, 1e-5)
    return dy, x, mean.to(device), rstd.to(device), w


# -- CPU: the reference's order against a scalar walk of the kernel ------------------------


def scalar_backward(dy, x, mean, rstd, w, geo):
    """The kernel's algorithm walked in numpy float32 scalars: ``(dx float32, dgamma, dbeta)``."""
    f = np.float32
    dy, x = dy.float().numpy(), x.float().numpy()
    mean, rstd = mean.reshape(-1).numpy(), rstd.reshape(-1).numpy()
    wv = np.ones(x.shape[1], np.float32) if w is None else w.numpy()
    m, n = x.shape
    nch = n // geo.width
    rounds = -(-nch // geo.threads)
    dx = np.zeros((m, n), np.float32)
    part_g = np.zeros((geo.tiles, n), np.float32)
    part_b = np.zeros((geo.tiles, n), np.float32)
    for tile in range(geo.tiles):
        acc_g = [[f(0)] * n for _ in range(geo.groups)]
        acc_b = [[f(0)] * n for _ in range(geo.groups)]
        for i in range(geo.rows_per_tile // geo.groups):
            for grp in range(geo.groups):
                row = tile * geo.rows_per_tile + i * geo.groups + grp
                if row >= m:
                    continue
                mu, rs = f(mean[row]), f(rstd[row])
                s1, s2 = [f(0)] * geo.threads, [f(0)] * geo.threads
                xh, gg = {}, {}
                for t in range(geo.threads):
                    for k in range(rounds):
                        c = t + k * geo.threads
                        if c >= nch:
                            continue
                        for e in range(geo.width):
                            col = c * geo.width + e
                            d = f(dy[row, col])
                            xh[col] = f(f(f(x[row, col]) - mu) * rs)
                            gg[col] = f(d * f(wv[col]))
                            s1[t] = f(s1[t] + gg[col])
                            s2[t] = f(s2[t] + f(gg[col] * xh[col]))
                            acc_g[grp][col] = f(acc_g[grp][col] + f(d * xh[col]))
                            acc_b[grp][col] = f(acc_b[grp][col] + d)
                totals = []
                for s in (s1, s2):
                    warp_sums = []
                    for w0 in range(0, geo.threads, 32):
                        lanes = s[w0 : w0 + 32]
                        for off in (16, 8, 4, 2, 1):
                            lanes = [f(lanes[j] + lanes[j ^ off]) for j in range(32)]
                        warp_sums.append(lanes[0])
                    total = warp_sums[0]
                    for ws in warp_sums[1:]:
                        total = f(total + ws)
                    totals.append(total)
                a, b = f(totals[0] / f(n)), f(totals[1] / f(n))
                for col in range(n):
                    dx[row, col] = f(f(f(gg[col] - a) - f(xh[col] * b)) * rs)
        for col in range(n):
            tg, tb = acc_g[0][col], acc_b[0][col]
            for grp in range(1, geo.groups):
                tg, tb = f(tg + acc_g[grp][col]), f(tb + acc_b[grp][col])
            part_g[tile, col], part_b[tile, col] = tg, tb
    out = []
    for part in (part_g, part_b):
        acc = [np.zeros(n, np.float32) for _ in range(ref.SUM_WARPS)]
        for j in range(geo.tiles):
            acc[j % ref.SUM_WARPS] = (acc[j % ref.SUM_WARPS] + part[j]).astype(np.float32)
        total = acc[0]
        for a in acc[1:]:
            total = (total + a).astype(np.float32)
        out.append(total)
    return dx, out[0], out[1]


@pytest.mark.parametrize(
    "m,n,dtype,tiles,max_threads",
    [
        (45, 64, torch.float32, 2, 512),  # 16 groups of one warp, 2 rows per group
        (13, 96, torch.float32, 3, 64),  # 2 groups, a partial last tile
        (9, 300, torch.float32, 2, 64),  # 2 chunks a thread, a partial second round
        (11, 72, torch.bfloat16, 2, 512),  # 9 chunks: a partial warp
        (3, 2056, torch.float32, 528, 512),  # the real constants: 2 rounds of 257 chunks
        (40, 16, torch.float32, 528, 512),  # 4 chunks: the butterfly over mostly idle lanes
    ],
)
@pytest.mark.parametrize("affine", [True, False])
def test_reference_order_is_the_kernels(m, n, dtype, tiles, max_threads, affine, monkeypatch):
    monkeypatch.setattr(ref, "BWD_TILES", tiles)
    monkeypatch.setattr(ref, "BWD_MAX_THREADS", max_threads)
    dy, x, mean, rstd, w = problem(m, n, dtype, seed=m * n, affine=affine)
    x[1, 3:9] = -x[1, 3:9]  # some exact cancellations
    geo = ref.backward_geometry(m, n, dtype)
    dx, dgamma, dbeta = ref.layer_norm_backward_reference(dy, x, mean, rstd, w, ALL)
    want_dx, want_g, want_b = scalar_backward(dy, x, mean, rstd, w, geo)
    assert dx.float().numpy().tobytes() == torch.from_numpy(want_dx).to(dtype).float().numpy().tobytes()
    assert dgamma.numpy().tobytes() == want_g.tobytes()
    assert dbeta.numpy().tobytes() == want_b.tobytes()


def test_geometry_of_the_shapes_that_matter():
    for m, n, dtype in ((32768, 768, torch.float32), (16384, 2048, torch.float32), (65536, 2048, torch.bfloat16)):
        geo = ref.backward_geometry(m, n, dtype)
        assert geo.threads % 32 == 0 and geo.groups * geo.threads <= ref.BWD_MAX_THREADS
        assert geo.rounds * geo.threads * geo.width >= n and geo.rows_per_tile % geo.groups == 0
        assert (geo.tiles - 1) * geo.rows_per_tile < m <= geo.tiles * geo.rows_per_tile <= ref.BWD_TILES * 2 * m
    assert ref.backward_geometry(32768, 768, torch.float32)[2:4] == (192, 2)
    assert ref.backward_geometry(100, layer_norm_max_width(torch.float32), torch.float32).rounds == 4


# -- CPU: against float64 math, arguments -----------------------------------------------


def float64_backward(dy, x, mean, rstd, w):
    n = x.shape[-1]
    wd = torch.ones(n, dtype=torch.float64) if w is None else w.double()
    return torch.ops.aten.native_layer_norm_backward(
        dy.double(), x.double(), [n], mean.double(), rstd.double(), wd, torch.zeros_like(wd), [True, True, True]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("affine", [True, False])
def test_reference_close_to_float64(dtype, affine):
    dy, x, mean, rstd, w = problem(700, 256, dtype, seed=3, affine=affine)
    dx, dgamma, dbeta = ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)
    want = float64_backward(dy, x, mean, rstd, w)
    assert dx.dtype == dtype and dgamma.dtype == dbeta.dtype == torch.float32 and dgamma.shape == (256,)
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(dx.double(), want[0], rtol=tol, atol=tol * want[0].abs().max().item())
    for got, exp in ((dgamma, want[1]), (dbeta, want[2])):
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-5 * exp.abs().max().item())


def test_output_mask_empty_rows_and_batched_shapes():
    dy, x, mean, rstd, w = problem(24, 64, torch.float32, seed=4)
    full = ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)
    for mask in ((True, False, False), (False, True, False), (False, False, True), (False, False, False)):
        got = ops.layer_norm_backward(dy, x, mean, rstd, w, mask)
        for want, g, on in zip(full, got, mask, strict=True):
            assert (g is None) == (not on) and (g is None or torch.equal(g, want))
    batched = ops.layer_norm_backward(dy.reshape(2, 12, 64), x.reshape(2, 12, 64), mean, rstd.reshape(2, 12, 1), w, ALL)
    assert batched[0].shape == (2, 12, 64) and torch.equal(batched[0].reshape(24, 64), full[0])
    assert torch.equal(batched[1], full[1]) and torch.equal(batched[2], full[2])
    e = torch.empty(0, 64)
    dx, dgamma, dbeta = ops.layer_norm_backward(e, e, torch.empty(0, 1), torch.empty(0, 1), w, ALL)
    assert dx.shape == (0, 64) and torch.equal(dgamma, torch.zeros(64)) and torch.equal(dbeta, torch.zeros(64))


def test_bad_arguments_name_the_argument():
    dy, x, mean, rstd, w = problem(4, 64, torch.float32, seed=5)
    cases = [
        (
            (dy[:, :62], x[:, :62], mean, rstd, None),
            r"x\.shape\[-1\]=.* is not allowed: expected a positive multiple of 4",
        ),
        ((dy[:, :30], x[:, :30], mean, rstd, None), r"x\.shape\[-1\]"),
        ((dy.double(), x.double(), mean, rstd, None), r"x\.dtype"),
        ((dy.bfloat16(), x, mean, rstd, w), r"grad_y\.dtype=.* is not allowed: expected torch\.float32"),
        ((dy[:3], x, mean, rstd, w), r"grad_y\.shape"),
        ((dy, x, mean[:3], rstd, w), r"mean\.numel\(\)=.* is not allowed: expected 4"),
        ((dy, x, mean, rstd.double(), w), r"rstd\.dtype"),
        ((dy, x, mean, rstd, w[:63]), r"weight\.shape=.* is not allowed: expected \(64,\)"),
        ((dy, x, mean, rstd, w.half()), r"weight\.dtype"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.layer_norm_backward(*args, ALL)
    limit = layer_norm_max_width(torch.float32)
    wide = torch.zeros(1, limit + 4)
    with pytest.raises(ValueError, match=r"x\.shape\[-1\]"):
        ops.layer_norm_backward(wide, wide, torch.zeros(1), torch.zeros(1), None, ALL)


def test_opcheck_on_cpu():
    dy, x, mean, rstd, w = problem(8, 64, torch.float32, seed=6)
    for weight, mask in ((w, [True, True, True]), (None, [True, False, True]), (w, [False, True, False])):
        torch.library.opcheck(torch.ops.fp8state.layer_norm_backward.default, (dy, x, mean, rstd, weight, mask))


# -- GPU: the kernel against the reference -------------------------------------------------


@pytest.fixture
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"


def check_kernel(dy, x, mean, rstd, w, mask=ALL, what=""):
    got = ops.layer_norm_backward(dy, x, mean, rstd, w, mask)
    cpu = (t if t is None else t.cpu() for t in (dy, x, mean, rstd, w))
    want = ref.layer_norm_backward_reference(*cpu, mask)
    for name, g, r in zip(("dx", "dgamma", "dbeta"), got, want, strict=True):
        assert (g is None) == (r is None), f"{name} {what}"
        if g is not None:
            assert g.is_cuda and same_bits(g, r), f"{name} differs from the reference {what}"
    return got


def gpu_widths(dtype) -> list[int]:
    v = 16 // torch.empty((), dtype=dtype).element_size()
    # one chunk; a partial warp; 768 and 2048 (the models'); one chunk past 512 threads (2
    # rounds); 3 rounds; the widest
    return [v, 9 * v, 768, 2048, 512 * v + v, 1300 * v, layer_norm_max_width(dtype)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_the_reference_bitwise(dtype, kernels):
    for i, n in enumerate(gpu_widths(dtype)):
        for m in (1, 67, 1100) if n <= 4096 else (1, 37):
            dy, x, mean, rstd, w = problem(m, n, dtype, seed=1000 * i + m, device="cuda", affine=i % 3 != 1)
            check_kernel(dy, x, mean, rstd, w, what=f"(m={m}, n={n}, {dtype})")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,n", [(32768, 768), (3001, 1024), (16384 + 5, 2048)])
def test_kernel_matches_the_reference_at_model_shapes(m, n, kernels):
    """Tiles of many rows (several per group), the last one partial."""
    for dtype, seed in ((torch.float32, 1), (torch.bfloat16, 2)):
        dy, x, mean, rstd, w = problem(m, n, dtype, seed=seed, device="cuda")
        check_kernel(dy, x, mean, rstd, w, what=f"(m={m}, n={n}, {dtype})")


@pytest.mark.gpu
@needs_cuda
def test_kernel_masks_nan_views_and_batched(kernels):
    dy, x, mean, rstd, w = problem(300, 768, torch.float32, seed=7, device="cuda")
    for mask in ((True, False, False), (False, True, False), (False, False, True), (False, True, True)):
        check_kernel(dy, x, mean, rstd, w, mask, what=str(mask))
    x_nan = x.clone()
    x_nan[5, 17] = float("nan")
    _, mean_nan, rstd_nan = ref_fwd.layer_norm_reference(x_nan.cpu(), None, None, 1e-5)
    got = check_kernel(dy, x_nan, mean_nan.cuda(), rstd_nan.cuda(), w, what="(a NaN row)")
    assert torch.isnan(got[0][5]).all() and not torch.isnan(got[0][4]).any() and torch.isnan(got[1]).all()
    wide = torch.randn(300, 2 * 768, device="cuda")
    check_kernel(wide[:, 768:], x, mean, rstd, w, what="(a strided grad_y)")
    shifted = torch.randn(300 * 768 + 1, device="cuda")[1:].reshape(300, 768)  # a 4-byte offset
    check_kernel(shifted, x, mean, rstd, w, what="(a misaligned grad_y)")
    check_kernel(dy.reshape(3, 100, 768), x.reshape(3, 100, 768), mean.reshape(3, 100, 1), rstd, None)
    e = torch.empty(0, 768, device="cuda")
    check_kernel(e, e, torch.empty(0, 1, device="cuda"), torch.empty(0, 1, device="cuda"), w, what="(no rows)")


@pytest.mark.gpu
@needs_cuda
def test_kernel_in_a_cuda_graph_without_host_sync(kernels):
    dy, x, mean, rstd, w = problem(4096, 768, torch.float32, seed=8, device="cuda")
    small = (dy[:64], x[:64], mean[:64], rstd[:64], w, list(ALL))
    torch.library.opcheck(torch.ops.fp8state.layer_norm_backward.default, small)
    fresh = [problem(4096, 768, torch.float32, seed=seed, device="cuda") for seed in (9, 10)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)
        ops.layer_norm_backward(dy, x, mean, rstd, None, (True, False, True))
        with torch.cuda.graph(graph):
            out = ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for inputs in fresh:  # fresh data into the captured inputs, then replay
        for dst, src in zip((dy, x, mean, rstd, w), inputs, strict=True):
            dst.copy_(src)
        graph.replay()
        eager = ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)
        for g, e in zip(out, eager, strict=True):
            assert same_bits(g, e)
    check_kernel(dy, x, mean, rstd, w, what="(after the graph)")


@pytest.mark.gpu
@needs_cuda
def test_kernel_close_to_torch(kernels):
    dy, x, mean, rstd, w = problem(2048, 1024, torch.float32, seed=11, device="cuda")
    got = ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)
    want = torch.ops.aten.native_layer_norm_backward(dy, x, [1024], mean, rstd, w, torch.zeros_like(w), list(ALL))
    for g, t in zip(got, want, strict=True):
        torch.testing.assert_close(g, t, rtol=1e-4, atol=1e-4 * t.abs().max().item())
