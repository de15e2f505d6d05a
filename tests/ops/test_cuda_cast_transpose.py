"""``quantize_fp8_t_record_amax`` (quantize + transpose + column sums, csrc/fp8_ops.cu) against
its pure-torch reference, bit for bit, on the GPU: codes, transposed codes, the recorded amax
and the float32 column sums, on fresh random data (never zeros), full 128-tiles and edges."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state import ops
from tests.ops.test_cuda_ops import edge_values, fresh, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernels run there only)"),
]

IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# full tiles (the 16-byte path); full tiles plus edge tiles; rows not a multiple of 16 (16-byte
# loads, the transposed tile stored byte by byte); an expert's share of the tokens (an odd row
# count over several row tiles); fewer rows or columns than a tile; the 124M grad_output shape
SHAPES = [(256, 384), (300, 200), (136, 256), (1003, 512), (7, 33), (1, 1), (128 * 33, 768)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert ops.cuda.ensure_loaded(), f"CUDA kernels failed to build/load: {ops.cuda.extension_info()}"


def _reference(x, scale, pending, slot, dtype, column_sum):
    """The op on CPU tensors: the reference kernel (CUDA's is registered for CUDA only)."""
    return ops.quantize_fp8_t_record_amax(x.cpu(), scale.cpu(), pending, slot, dtype, column_sum)


@pytest.mark.parametrize("fmt", [f8s.E4M3, f8s.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_bitwise(fmt, dtype, shape):
    x = fresh(shape[0] * shape[1], dtype, seed=sum(shape)).view(shape)
    for scale_value, column_sum in ((1.0, True), (0.37109375, False), (1234.5, True)):
        scale = torch.tensor([scale_value], device="cuda")
        pending = torch.rand(3, device="cuda") * 1e-3
        pending_ref = pending.cpu().clone()
        q, q_t, sums = ops.quantize_fp8_t_record_amax(x, scale, pending, 1, fmt.dtype, column_sum)
        rq, rq_t, rsums = _reference(x, scale, pending_ref, 1, fmt.dtype, column_sum)
        assert q.is_contiguous() and q_t.is_contiguous() and q_t.shape == (shape[1], shape[0])
        assert same_bits(q, rq) and same_bits(q_t, rq_t), (shape, dtype, scale_value)
        assert same_bits(q, ops.quantize_fp8_reference(x.cpu(), scale.cpu(), fmt.dtype))
        assert same_bits(pending, pending_ref)
        assert same_bits(sums, rsums)
        assert sums.numel() == (shape[1] if column_sum else 0)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_edge_values_nan_inf_and_column_sums(dtype):
    x = fresh(256 * 256, dtype, seed=5).view(256, 256)
    edges = edge_values(dtype, f8s.E5M2).cuda()
    x[3, : edges.numel()] = edges  # a NaN in several columns, infinities in others
    x[100:, 40] = torch.tensor(float("inf"), dtype=dtype)
    x[:, 41] = torch.tensor(float("inf"), dtype=dtype)
    x[::2, 42], x[1::2, 42] = float("inf"), float("-inf")  # inf - inf: NaN
    scale = torch.tensor([2.0], device="cuda")
    pending, pending_ref = torch.zeros(1, device="cuda"), torch.zeros(1)
    got = ops.quantize_fp8_t_record_amax(x, scale, pending, 0, torch.float8_e5m2, True)
    want = _reference(x, scale, pending_ref, 0, torch.float8_e5m2, True)
    for a, b in zip(got, want, strict=True):
        assert same_bits(a, b)
    assert same_bits(pending, pending_ref) and torch.isnan(pending).all()
    assert torch.isnan(got[2][42]) and torch.isinf(got[2][41])


def test_views_and_misaligned_input():
    base = fresh(512 * 264, torch.bfloat16, seed=9).view(512, 264)
    scale = torch.tensor([3.0], device="cuda")
    for view in (base[:, 8:], base.reshape(-1)[1 : 1 + 256 * 256].view(256, 256), base[:256, :256].t()):
        pending, pending_ref = torch.zeros(1, device="cuda"), torch.zeros(1)
        got = ops.quantize_fp8_t_record_amax(view, scale, pending, 0, torch.float8_e4m3fn, True)
        want = _reference(view, scale, pending_ref, 0, torch.float8_e4m3fn, True)
        assert all(same_bits(a, b) for a, b in zip(got, want, strict=True))
        assert same_bits(pending, pending_ref)


def test_column_sums_are_close_to_exact_sums():
    x = torch.randn(4096, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(torch.bfloat16)
    ones, pending = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    _, _, sums = ops.quantize_fp8_t_record_amax(x, ones, pending, 0, torch.float8_e5m2, True)
    exact = x.double().sum(0)
    assert torch.allclose(sums.double(), exact, rtol=1e-5, atol=1e-3)


def test_checks_opcheck_graph_capture_and_no_host_sync():
    x = fresh(512 * 384, torch.bfloat16, seed=4).view(512, 384)
    s = torch.tensor([2.0], device="cuda")
    with pytest.raises(ValueError, match=r"x.dim\(\)=.* is not allowed: expected 2"):
        ops.quantize_fp8_t_record_amax(
            x.view(2, 256, 384), s, torch.zeros(1, device="cuda"), 0, torch.float8_e5m2, True
        )
    with pytest.raises(ValueError, match=r"slot"):
        ops.quantize_fp8_t_record_amax(x, s, torch.zeros(1, device="cuda"), 1, torch.float8_e5m2, True)
    torch.library.opcheck(
        torch.ops.fp8state.quantize_fp8_t_record_amax.default,
        (x, s, torch.zeros(2, device="cuda"), 1, torch.float8_e5m2, True),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )
    pending = torch.zeros(1, device="cuda")
    ops.quantize_fp8_t_record_amax(x, s, pending, 0, torch.float8_e5m2, True)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = ops.quantize_fp8_t_record_amax(x, s, pending, 0, torch.float8_e5m2, True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.quantize_fp8_t_record_amax(x, s, pending, 0, torch.float8_e5m2, True)
        with torch.cuda.graph(graph):
            captured = ops.quantize_fp8_t_record_amax(x, s, pending, 0, torch.float8_e5m2, True)
    torch.cuda.current_stream().wait_stream(side)
    x.copy_(fresh(512 * 384, torch.bfloat16, seed=5).view(512, 384))
    graph.replay()
    want = _reference(x, s, torch.zeros(1), 0, torch.float8_e5m2, True)
    assert all(same_bits(a, b) for a, b in zip(captured, want, strict=True))  # the replay read the new x
    assert not same_bits(eager[0], captured[0])
