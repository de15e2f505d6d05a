"""The stateless-scaling kernels (``csrc/dynamic_ops.cu``: ``fp8_current`` and ``fp8_rowwise``)
against their pure-torch references (``ops/reference_dynamic.py``), bit for bit, on the GPU.

Every output is compared: the codes, and the scale, descale and amax the kernel derived from
its input. Inputs are fresh random data over many decades, with the edge values of
``test_cuda_ops`` (NaN of either sign, infinities, subnormals, values past the format's max)
written into some of them, and rows of every length the rowwise kernel treats differently:
held in registers, re-read from L2, element by element.
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state import ops
from lightning_fp8state.ops import library_dynamic as dyn
from lightning_fp8state.ops import reference_dynamic as ref
from tests.ops.kernel_data import full_range
from tests.ops.test_cuda_ops import IN_DTYPES, edge_values, fresh, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)"),
]

FORMATS = pytest.mark.parametrize("fmt", [f8s.E4M3, f8s.E5M2], ids=["e4m3", "e5m2"])
DTYPES = pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"


def assert_matches(got, want):
    names = ("codes", "scale", "descale", "amax")
    for name, a, b in zip(names, got, want, strict=True):
        assert same_bits(a, b), f"{name} differs from the reference"


def current_reference(x, fmt, margin):
    return ref.quantize_fp8_current_reference(x.cpu(), fmt.dtype, margin)


def rowwise_reference(x, fmt, margin):
    return ref.quantize_fp8_rowwise_reference(x.cpu(), fmt.dtype, margin)


# -- fp8_current -----------------------------------------------------------------------------
@FORMATS
@DTYPES
@pytest.mark.parametrize("n", [1, 15, 17, 4096, 2**20 + 3])
@pytest.mark.parametrize("margin", [0, 3])
def test_current_matches_reference_bitwise(fmt, dtype, n, margin):
    x = fresh(n, dtype, seed=n + margin)
    got = dyn.quantize_fp8_current(x, fmt.dtype, margin)
    assert_matches(got, current_reference(x, fmt, margin))
    assert got[0].dtype == fmt.dtype and got[0].shape == x.shape and got[1].shape == ()
    # current_scale: the first half alone (grad_output's scales before its cast-transpose)
    want = ref.current_scale_reference(x.cpu(), fmt.dtype, margin)
    assert all(same_bits(a, b) for a, b in zip(dyn.current_scale(x, fmt.dtype, margin), want, strict=True))


@FORMATS
@DTYPES
def test_current_edge_values_and_guards(fmt, dtype):
    """NaN anywhere: the canonical NaN amax and scale 1; an infinity: scale 1 (not finite);
    all zeros: scale 1; subnormal-only data: a finite or guarded scale, as the reference."""
    base = fresh(4099, dtype, seed=7)
    edges = edge_values(dtype, fmt).cuda()
    with_nan = base.clone()
    with_nan[100 : 100 + edges.numel()] = edges
    with_inf = base.clone()
    with_inf[4098] = float("inf")
    tiny = (fresh(333, torch.float32, seed=8).sign() * torch.finfo(dtype).tiny / 8).to(dtype)
    for x in (with_nan, with_inf, torch.zeros(64, dtype=dtype, device="cuda"), tiny):
        for margin in (0, 5):
            assert_matches(dyn.quantize_fp8_current(x, fmt.dtype, margin), current_reference(x, fmt, margin))


@DTYPES
def test_current_full_range_and_views(dtype):
    """Scales from the whole float32 range (full_range's binades), a misaligned view and a
    non-contiguous one."""
    x = full_range((96, 40), dtype, seed=3, device="cuda")
    for t in (x, x[1:], x.t(), x.reshape(-1)[3:]):
        assert_matches(dyn.quantize_fp8_current(t, f8s.E4M3.dtype, 0), current_reference(t, f8s.E4M3, 0))


def test_current_empty():
    x = torch.empty(0, 16, dtype=torch.bfloat16, device="cuda")
    assert_matches(dyn.quantize_fp8_current(x, f8s.E4M3.dtype, 0), current_reference(x, f8s.E4M3, 0))


# -- fp8_rowwise -----------------------------------------------------------------------------
# (rows, columns): one element; widths that are not whole 16-byte loads (element by element);
# rows held in registers at every group size (32..256 threads); rows longer than the registers
# hold (re-read), with bf16 above 16 Ki columns and float32 above 8 Ki; odd row counts.
ROW_SHAPES = [(1, 1), (3, 17), (5, 8), (9, 1001), (7, 4096), (33, 1000), (2, 2048 * 8 + 8), (3, 40000), (257, 64)]


@FORMATS
@DTYPES
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rowwise_matches_reference_bitwise(fmt, dtype, shape):
    r, c = shape
    x = fresh(r * c, dtype, seed=r * 7919 + c).view(r, c)
    # every row its own magnitude, so that a scale taken from the wrong row shows
    x = (x.float() * torch.logspace(-6, 6, r, device="cuda").unsqueeze(1)).to(dtype)
    for margin in (0, 2):
        got = dyn.quantize_fp8_rowwise(x, fmt.dtype, margin)
        assert_matches(got, rowwise_reference(x, fmt, margin))
        assert got[1].shape == (r, 1)


@FORMATS
@DTYPES
def test_rowwise_edge_rows(fmt, dtype):
    """A row with NaN, one with an infinity, one of zeros, one subnormal, beside plain rows:
    each row's guard applies to that row only."""
    x = (fresh(8 * 512, torch.float32, seed=11) * 1e-3).to(dtype).view(8, 512)  # finite in float16 too
    edges = edge_values(dtype, fmt).cuda()
    x[1, : edges.numel()] = edges
    x[3, 200] = float("-inf")
    x[4] = 0
    x[6] = (x[6].float().sign() * torch.finfo(dtype).tiny / 4).to(dtype)
    got = dyn.quantize_fp8_rowwise(x, fmt.dtype, 0)
    assert_matches(got, rowwise_reference(x, fmt, 0))
    assert got[1][0].item() != 1.0 and got[1][4].item() == 1.0  # a real scale; the zero row's guard


@DTYPES
def test_rowwise_full_range_views_and_empty(dtype):
    x = full_range((130, 48), dtype, seed=5, device="cuda")
    for t in (
        x,
        x[1:],
        x.t(),
        torch.empty(0, 8, dtype=dtype, device="cuda"),
        torch.empty(4, 0, dtype=dtype, device="cuda"),
    ):
        assert_matches(dyn.quantize_fp8_rowwise(t, f8s.E5M2.dtype, 1), rowwise_reference(t, f8s.E5M2, 1))


# -- fp8_rowwise's backward operands: per-column scales, codes transposed ----------------------
# (rows, columns): whole 128 x 128 tiles; partial tiles on either edge; rows not a multiple of 16
# (the element-wise tile path); widths that are not whole 16-byte loads; one row; one column;
# the backward's shapes (tokens x features), tall and wide.
COL_SHAPES = [
    (1, 1),
    (3, 17),
    (16, 8),
    (128, 128),
    (130, 200),
    (200, 130),
    (256, 1000),
    (1000, 264),
    (1003, 512),  # an odd row count over full tiles: 16-byte loads, the transposed tile byte by byte
    (37, 4096),
    (4096, 96),
]


def colwise_reference(x, fmt, margin):
    return ref.quantize_fp8_colwise_reference(x.cpu(), fmt.dtype, margin)


@FORMATS
@DTYPES
@pytest.mark.parametrize("shape", COL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_colwise_matches_reference_bitwise(fmt, dtype, shape):
    r, c = shape
    x = fresh(r * c, dtype, seed=r * 131 + c).view(r, c)
    # every column its own magnitude, so that a scale taken from the wrong column shows
    x = (x.float() * torch.logspace(-6, 6, c, device="cuda").unsqueeze(0)).to(dtype)
    for margin in (0, 2):
        got = dyn.quantize_fp8_colwise(x, fmt.dtype, margin)
        assert_matches(got, colwise_reference(x, fmt, margin))
        assert got[0].shape == (c, r) and got[0].is_contiguous() and got[1].shape == (c, 1)
        # the same as the rowwise kernel of the high-precision transpose, bit for bit
        assert_matches(got, dyn.quantize_fp8_rowwise(x.t().contiguous(), fmt.dtype, margin))


@FORMATS
@DTYPES
def test_colwise_edge_columns(fmt, dtype):
    """A column with NaN, one with an infinity, one of zeros, one subnormal, beside plain ones,
    across several row chunks of the amax kernel: each column's guard applies to it only."""
    x = (fresh(4096 * 256, torch.float32, seed=12) * 1e-3).to(dtype).view(4096, 256)  # finite in float16
    edges = edge_values(dtype, fmt).cuda()
    x[3000 : 3000 + edges.numel(), 1] = edges
    x[4095, 3] = float("-inf")
    x[:, 4] = 0
    x[:, 6] = (x[:, 6].float().sign() * torch.finfo(dtype).tiny / 4).to(dtype)
    x[2049, 200] = float("nan")
    got = dyn.quantize_fp8_colwise(x, fmt.dtype, 0)
    assert_matches(got, colwise_reference(x, fmt, 0))
    assert got[1][0].item() != 1.0 and got[1][4].item() == 1.0 and torch.isnan(got[3][200]).item()


@DTYPES
def test_colwise_full_range_views_and_empty(dtype):
    x = full_range((130, 48), dtype, seed=6, device="cuda")
    for t in (
        x,
        x[1:],
        x.t(),
        x[:, 1:],
        torch.empty(0, 8, dtype=dtype, device="cuda"),
        torch.empty(4, 0, dtype=dtype, device="cuda"),
    ):
        assert_matches(dyn.quantize_fp8_colwise(t, f8s.E5M2.dtype, 1), colwise_reference(t, f8s.E5M2, 1))


# -- argument checks, opcheck, graphs, no host sync -----------------------------------------
def test_bad_arguments_name_what_is_allowed():
    x = fresh(64, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match=r"x.dim\(\)=.* is not allowed: expected 2"):
        dyn.quantize_fp8_rowwise(x, f8s.E4M3.dtype, 0)
    with pytest.raises(ValueError, match=r"margin"):
        dyn.quantize_fp8_current(x, f8s.E4M3.dtype, -1)
    with pytest.raises(ValueError, match=r"x.dtype"):
        dyn.quantize_fp8_current(x.to(torch.int32), f8s.E4M3.dtype, 0)
    with pytest.raises(ValueError, match=r"dtype"):
        dyn.quantize_fp8_current(x, torch.bfloat16, 0)


def test_current_scale_opcheck():
    x = fresh(384 * 512, torch.bfloat16, seed=6).view(384, 512)
    torch.library.opcheck(
        torch.ops.fp8state.current_scale.default,
        (x, f8s.E5M2.dtype, 2),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("op", ["quantize_fp8_current", "quantize_fp8_rowwise", "quantize_fp8_colwise"])
def test_opcheck_graph_capture_and_no_host_sync(op):
    fn = getattr(dyn, op)
    x = fresh(384 * 512, torch.bfloat16, seed=4).view(384, 512)
    torch.library.opcheck(
        getattr(torch.ops.fp8state, op).default,
        (x, f8s.E4M3.dtype, 1),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    fn(x, f8s.E4M3.dtype, 0)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = fn(x, f8s.E4M3.dtype, 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x, f8s.E4M3.dtype, 0)
        with torch.cuda.graph(graph):
            captured = fn(x, f8s.E4M3.dtype, 0)
    torch.cuda.current_stream().wait_stream(side)
    x.copy_(fresh(384 * 512, torch.bfloat16, seed=5).view(384, 512) * 3)
    graph.replay()
    want = {"current": current_reference, "rowwise": rowwise_reference, "colwise": colwise_reference}[
        op.rsplit("_", 1)[1]
    ](x, f8s.E4M3, 0)
    assert_matches(captured, want)  # the replay read the new x and derived its scales on the device
    assert not same_bits(eager[1], captured[1])


FIRST_CALL = """
import torch
from torch.profiler import ProfilerActivity, profile
from lightning_fp8state.ops import cuda
from lightning_fp8state.ops import library_dynamic as dyn
x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
assert not cuda._state["tried"]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    dyn.{op}(x, torch.float8_e4m3fn, 0)
    torch.cuda.synchronize()
names = sorted({{e.key for e in prof.key_averages()}})
print(names)
assert cuda.is_loaded(), cuda.extension_info()
assert any("{kernel}" in n for n in names), names
assert not any(n.startswith("aten::") for n in names), names
"""


@pytest.mark.parametrize(
    ("op", "kernel"),
    [
        ("quantize_fp8_rowwise", "rowwise_kernel"),
        ("quantize_fp8_current", "amax_kernel"),
        ("current_scale", "amax_kernel"),
        ("quantize_fp8_colwise", "colwise_t_kernel"),
    ],
)
def test_the_first_call_in_a_fresh_process_runs_the_kernel_not_the_reference(op, kernel):
    """An op reached on a CUDA tensor before anything loaded the extension ran the reference
    (dispatch's CompositeExplicitAutograd): fp8_rowwise trained on it, 4x slower, on the H200."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", FIRST_CALL.format(op=op, kernel=kernel)], capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout + run.stderr
