"""The saturation counts of the recording quantize kernels against the CPU reference's, exactly.

Each recording FP8 op (plain, cast-transpose, GELU, LayerNorm, RMSNorm, SwiGLU) adds, with a
``saturation`` counter, the elements whose ``|float32(y) * scale|`` exceeds the format's max to
row 0 of the owner's column and the elements encoded to row 1. On fresh random data, with a
scale that makes a known share clip (never none), the CUDA count equals the reference's, and
the codes and amax stay bit for bit the reference's. Skipped without a CUDA device; on one the
kernels MUST build.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fp8state import ops
from lightning_fp8state.formats import fp8_format
from lightning_fp8state.ops.reference_fused import gelu_reference
from lightning_fp8state.ops.reference_swiglu import swiglu_f32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SLOT, OWNERS = 2, 5


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"


def _scale_for(y: torch.Tensor, dtype: torch.dtype, share: float) -> torch.Tensor:
    """A float32 scale under which about ``share`` of ``y``'s finite elements clip: fmax over
    the (1 - share) quantile of |y| (so the count is neither 0 nor everything)."""
    a = y.detach().float().abs().flatten()
    a = a[torch.isfinite(a)]
    q = torch.quantile(a[: 2**24].cpu(), 1.0 - share).item()
    return torch.tensor(fp8_format(dtype).max / max(q, 1e-30), dtype=torch.float32)


def _run(call, device: str) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """``call(pending, saturation)`` on ``device`` with a fresh counter that already holds counts
    (the op adds to them); returns (outputs on the CPU, pending, saturation)."""
    pending = torch.zeros(OWNERS, device=device)
    sat = torch.full((2, OWNERS), 7, dtype=torch.int64, device=device)
    out = call(pending, sat)
    out = out if isinstance(out, tuple) else (out,)
    return tuple(o.cpu() for o in out), pending.cpu(), sat.cpu()


def _check(call_on, scale_source: torch.Tensor, fmt_dtype: torch.dtype, numel: int) -> None:
    got, gp, gs = _run(lambda p, s: call_on("cuda", p, s), "cuda")
    want, wp, ws = _run(lambda p, s: call_on("cpu", p, s), "cpu")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
    assert torch.equal(gp.view(torch.int32), wp.view(torch.int32))
    assert torch.equal(gs, ws), f"CUDA counts {gs[:, SLOT].tolist()} != reference {ws[:, SLOT].tolist()}"
    clipped = ws[0, SLOT].item() - 7
    assert ws[1, SLOT].item() - 7 == numel
    if numel >= 64:  # the scale makes a share clip: neither none nor all
        assert 0 < clipped < numel
    others = [i for i in range(OWNERS) if i != SLOT]
    assert torch.equal(gs[:, others], torch.full((2, OWNERS - 1), 7, dtype=torch.int64))


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
    return x.to(dtype)


def _on(x: torch.Tensor, device: str, noncontig: bool) -> torch.Tensor:
    """``x`` on ``device``; with ``noncontig`` as a strided view there (every other column of a
    wider tensor), so the kernel's own handling of a strided input is what runs."""
    if not noncontig:
        return x.to(device)
    wide = torch.zeros(*x.shape[:-1], x.shape[-1] * 2, dtype=x.dtype, device=device)
    wide[..., ::2] = x.to(device)
    view = wide[..., ::2]
    assert x.numel() == 0 or not view.is_contiguous()
    return view


SHAPES = [(0, 64), (1, 16), (3, 24), (64, 256), (257, 1000), (1024, 4096)]


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("noncontig", [False, True])
def test_quantize_record_counts(dtype, fmt, shape, noncontig):
    x = _data(shape, dtype, 1 + shape[0])
    scale = _scale_for(x, fmt, 0.03) if x.numel() else torch.tensor(1.0)

    def call(dev, p, s):
        return ops.quantize_fp8_record_amax(_on(x, dev, noncontig), scale.to(dev), p, SLOT, fmt, s)

    _check(call, x, fmt, x.numel())


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", [(0, 16), (5, 24), (128, 128), (300, 520), (2048, 1024)])
@pytest.mark.parametrize("column_sum", [False, True])
@pytest.mark.parametrize("noncontig", [False, True])
def test_cast_transpose_counts(dtype, shape, column_sum, noncontig):
    x = _data(shape, dtype, 7 + shape[1])
    scale = _scale_for(x, E5M2, 0.02) if x.numel() else torch.tensor(1.0)

    def call(dev, p, s):
        return ops.quantize_fp8_t_record_amax(_on(x, dev, noncontig), scale.to(dev), p, SLOT, E5M2, column_sum, s)

    _check(call, x, E5M2, x.numel())


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", [(0, 64), (7, 33), (256, 1024)])
def test_gelu_counts(dtype, shape):
    x = _data(shape, dtype, 11)
    y = gelu_reference(x) if x.numel() else x
    scale = _scale_for(y, E4M3, 0.05) if x.numel() else torch.tensor(1.0)

    # torch's CUDA GELU is the definition (its erf differs from the CPU's in the last ulp): the
    # reference quantizes F.gelu computed on the GPU, with the CPU quantize reference
    y_gpu = gelu_reference(x.cuda()).cpu()

    def call(dev, p, s):
        if dev == "cpu":
            return ops.quantize_fp8_record_amax(y_gpu, scale, p, SLOT, E4M3, s)
        return ops.gelu_quantize_fp8(_on(x, dev, True), scale.to(dev), E4M3, p, SLOT, s)

    _check(call, y, E4M3, x.numel())


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", [(0, 64), (3, 64), (200, 1024), (64, 8192)])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("noncontig", [False, True])
def test_norm_counts(dtype, shape, affine, norm, noncontig):
    x = _data(shape, dtype, 13)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(shape[-1], generator=g) * 2 if affine else None
    b = torch.randn(shape[-1], generator=g) if affine else None
    scale = torch.tensor(fp8_format(E4M3).max / 2.0)  # a normalized row is ~N(0, 1): ~5% past 2

    def call(dev, p, s):
        wd = None if w is None else w.to(dev)
        if norm == "rms":
            return ops.rms_norm_quantize_fp8(_on(x, dev, noncontig), wd, 1e-6, scale.to(dev), E4M3, p, SLOT, s)
        bd = None if b is None else b.to(dev)
        return ops.layer_norm_quantize_fp8(_on(x, dev, noncontig), wd, bd, 1e-5, scale.to(dev), E4M3, p, SLOT, s)

    _check(call, x, E4M3, x.numel())


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", [(0, 32), (5, 30), (64, 2048), (129, 4104)])
@pytest.mark.parametrize("noncontig", [False, True])
def test_swiglu_counts(dtype, shape, noncontig):
    h = _data(shape, dtype, 17)
    y = swiglu_f32(h)
    scale = _scale_for(y, E4M3, 0.04) if y.numel() else torch.tensor(1.0)

    def call(dev, p, s):
        return ops.swiglu_quantize_fp8(_on(h, dev, noncontig), scale.to(dev), E4M3, p, SLOT, s)

    _check(call, y, E4M3, y.numel())


def test_nonfinite_counts():
    """An infinity clips (counted), a NaN does not, on both paths."""
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0, 1000.0, -449.0] * 11)
    scale = torch.tensor(1.0)

    def call(dev, p, s):
        return ops.quantize_fp8_record_amax(x.to(dev), scale.to(dev), p, SLOT, E4M3, s)

    _check(call, x, E4M3, x.numel())
    sat = torch.zeros(2, OWNERS, dtype=torch.int64, device="cuda")
    ops.quantize_fp8_record_amax(x.cuda(), scale.cuda(), torch.zeros(OWNERS, device="cuda"), SLOT, E4M3, sat)
    assert sat[0, SLOT].item() == 4 * 11


def test_counts_replay_in_a_cuda_graph():
    """Captured once and replayed, the kernel adds the same count on every replay (no host
    work per call): after k replays the counter holds k times one eager call's count."""
    x = _data((512, 1024), torch.bfloat16, 3).cuda()
    scale = _scale_for(x.cpu(), E4M3, 0.03).cuda()
    pending = torch.zeros(OWNERS, device="cuda")
    eager = torch.zeros(2, OWNERS, dtype=torch.int64, device="cuda")
    ops.quantize_fp8_record_amax(x, scale, pending, SLOT, E4M3, eager)
    sat = torch.zeros(2, OWNERS, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        ops.quantize_fp8_record_amax(x, scale, pending, SLOT, E4M3, torch.zeros_like(sat))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.quantize_fp8_record_amax(x, scale, pending, SLOT, E4M3, sat)
    sat.zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert eager[0, SLOT].item() > 0
    assert torch.equal(sat, eager * 3)


def test_graphed_blocks_count_what_the_eager_run_counts():
    """GraphedBlocks with real CUDA graphs (tests/unit/test_block_graphs.py's net and inputs,
    growing 1.5x an event so the delayed scales clip): the bank's counters after the run are
    bitwise the eager run's, and something clipped."""
    from lightning_fp8state.graphs import CudaGraphBackend
    from tests.unit.test_block_graphs import N_EVENTS, WARMUP, train

    ref_state, _, _, _, _ = train(False, device="cuda")
    state, model, _, _, _ = train(True, device="cuda", backend=CudaGraphBackend())
    assert model.runner.replays == N_EVENTS - WARMUP
    assert torch.equal(ref_state.bank.saturation.cpu(), state.bank.saturation.cpu())
    assert int(state.bank.saturation[1].min()) > 0 and int(state.bank.saturation[0].sum()) > 0


def test_opcheck_with_a_counter_on_cuda():
    """The schema's mutation annotations, the fake kernel and the CUDA kernel agree (the counter
    is a declared mutated argument)."""
    x, s = torch.randn(64, 128, device="cuda"), torch.tensor([2.0], device="cuda")
    pending, sat = torch.zeros(2, device="cuda"), torch.zeros(2, 2, dtype=torch.int64, device="cuda")
    f8 = torch.ops.fp8state
    torch.library.opcheck(f8.quantize_fp8_record_amax.default, (x, s, pending, 1, E4M3, sat))
    torch.library.opcheck(f8.quantize_fp8_t_record_amax.default, (x, s, pending, 1, E5M2, True, sat))
    torch.library.opcheck(f8.gelu_quantize_fp8_record_amax.default, (x, s, pending, 0, E4M3, sat))
    torch.library.opcheck(f8.rms_norm_quantize_fp8_record_amax.default, (x, None, 1e-6, s, pending, 0, E4M3, sat))
    torch.library.opcheck(f8.swiglu_quantize_fp8_record_amax.default, (x, s, pending, 0, E4M3, sat))
    torch.library.opcheck(
        f8.layer_norm_quantize_fp8_record_amax.default, (x, None, None, 1e-5, s, pending, 0, E4M3, sat)
    )
