"""The stateless recipes on the GPU (issue 28): written without a device, to run on the H200.

Mirrors tests/unit/test_recipes.py: the ops on CUDA bitwise their CPU reference; the rowwise
``torch._scaled_mm`` path (scale_a [M, 1], scale_b [1, N]) against the emulation; recompute
bitwise the true forward and checkpointed gradients bitwise the uncheckpointed ones under every
engine, in bf16 with the real GEMMs.
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.nn import gemm
from lightning_fp8state.ops.library_dynamic import quantize_fp8_current, quantize_fp8_rowwise
from lightning_fp8state.quant_recipes.rowwise import rowwise_matmul
from tests.conftest import ENGINE_IDS, ENGINES, bitwise_equal, make_stack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STATELESS = ["fp8_current", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise"]
D = 256
E4M3_GRADIENTS = ("fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise")  # as configs/quant/<recipe>.yaml ships them


@pytest.mark.parametrize("op", [quantize_fp8_current, quantize_fp8_rowwise])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dynamic_quantize_on_cuda_is_bitwise_the_cpu_reference(op, dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(130, 257, generator=g) * torch.logspace(-4, 4, 130).unsqueeze(1)
    x[3] = 0.0
    x[5, 1] = float("nan")
    for src in (x, x.bfloat16()):
        cpu = op(src, dtype, 0)
        gpu = op(src.cuda(), dtype, 0)
        for a, b in zip(cpu, gpu, strict=True):
            assert bitwise_equal(a, b.cpu())


def test_rowwise_scaled_mm_agrees_with_the_emulation():
    assert gemm.scaled_mm_available(torch.device("cuda")), "no FP8 _scaled_mm on this GPU (needs sm_89+)"
    g = torch.Generator(device="cuda").manual_seed(1)
    a, _, da, _ = quantize_fp8_rowwise(torch.randn(128, 256, device="cuda", generator=g), torch.float8_e4m3fn, 0)
    w, _, dw, _ = quantize_fp8_rowwise(torch.randn(64, 256, device="cuda", generator=g), torch.float8_e4m3fn, 0)
    bias = torch.randn(64, device="cuda", generator=g).bfloat16()
    mm = rowwise_matmul(a, w.t(), da, dw.t(), torch.bfloat16, "scaled_mm", bias)
    em = rowwise_matmul(a, w.t(), da, dw.t(), torch.bfloat16, "emulated", bias)
    # cuBLASLt accumulates in another order: equal to the emulation within bf16 rounding
    assert torch.allclose(mm.float(), em.float(), rtol=2**-7, atol=1e-2)
    # a float32 output (the backward's gradients of float32 tensors): the bf16 GEMM widened, the
    # bias added in float32, not the float32 emulation; bitwise that by construction
    mm32 = rowwise_matmul(a, w.t(), da, dw.t(), torch.float32, "auto", bias)
    widened = rowwise_matmul(a, w.t(), da, dw.t(), torch.bfloat16, "scaled_mm", None).float() + bias.float()
    assert mm32.dtype == torch.float32 and torch.equal(mm32, widened)
    assert torch.allclose(mm32, em.float(), rtol=2**-7, atol=1e-2)


def run(recipe, ckpt, n_events=3, d=D, tokens=64):
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe, backward_format="e4m3" if recipe in E4M3_GRADIENTS else "e5m2"))
    model = state.convert(make_stack(n=4, d=d, ckpt=ckpt)).cuda().bfloat16()
    g = torch.Generator(device="cuda").manual_seed(0)
    outs, grads = [], []
    with f8s.RecomputeAuditor(state) as auditor:
        for i in range(n_events):
            x = (torch.randn(tokens, d, device="cuda", generator=g) * 1.5**i).bfloat16().requires_grad_(True)
            model.zero_grad(set_to_none=True)
            with state.step(i):
                y = model(x)
                y.float().pow(2).mean().backward()
            outs.append(y.detach().clone())
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()} | {"x": x.grad.clone()})
    return auditor.report(), outs, grads


@pytest.mark.parametrize("recipe", STATELESS)
@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_recompute_and_gradients_are_bitwise_on_the_gpu(recipe, ckpt):
    _, outs_ref, grads_ref = run(recipe, None)
    report, outs, grads = run(recipe, ckpt)
    assert report.ok, report.format_table()
    for e, (a, b) in enumerate(zip(grads_ref, grads, strict=True)):
        assert bitwise_equal(outs_ref[e], outs[e])
        for name in a:
            assert bitwise_equal(a[name], b[name]), f"{recipe} event {e}: grad of {name} differs"


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_blockwise_recompute_and_gradients_are_bitwise_with_the_block_scaled_gemm(ckpt):
    """fp8_blockwise at a shape where all three GEMMs take cuBLASLt's block-scaled path (K a
    multiple of 512, the tokens too for the weight gradient)."""
    _, outs_ref, grads_ref = run("fp8_blockwise", None, d=512, tokens=512)
    report, outs, grads = run("fp8_blockwise", ckpt, d=512, tokens=512)
    assert report.ok, report.format_table()
    for e, (a, b) in enumerate(zip(grads_ref, grads, strict=True)):
        assert bitwise_equal(outs_ref[e], outs[e])
        for name in a:
            assert bitwise_equal(a[name], b[name]), f"event {e}: grad of {name} differs"
