"""``fp8_blockwise`` on the CPU, beyond what every recipe passes (test_recipe_conformance.py): a
linear call's three GEMMs read each operand at its declared tiles (checked against products of
operands dequantized here, tile by tile, with a different magnitude in every tile, so a scale
read at the wrong tile is off by powers of two), the emulated GEMM of one K slice is exactly its
formula, and the telemetry reports the tiles' scales."""

from __future__ import annotations

import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.quant_recipes import recipe_for
from lightning_fp8state.quant_recipes.blockwise import _widened_with_bias, blockwise_matmul
from tests.conftest import bitwise_equal
from tests.ops.test_reference_blockwise import fresh, tiled_by_loop

E4M3 = torch.float8_e4m3fn


def dequantized(x: torch.Tensor, rows: int, cols: int, pow2: bool = False) -> torch.Tensor:
    """``x`` through E4M3 codes in ``rows x cols`` tiles and back, float64 (the test's own loop)."""
    q, _, descale, _ = tiled_by_loop(x.detach(), rows, cols, E4M3, 0, pow2)
    per_element = descale.repeat_interleave(rows, 0)[: x.shape[0]].repeat_interleave(cols, 1)[:, : x.shape[1]]
    return q.double() * per_element.double()


def close(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` is ``a @ b`` up to float32 accumulation: within 1e-5 of ``|a| @ |b|`` everywhere."""
    want, bound = a @ b, a.abs() @ b.abs()
    err = (got.double() - want).abs()
    assert torch.all(err <= 1e-5 * bound + 1e-30), (err / bound.clamp(min=1e-30)).max()


def test_a_linear_calls_three_gemms_read_each_operand_at_its_tiles():
    state = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_blockwise_pow2", backward_format="e4m3"))
    layer = state.convert(nn.Sequential(nn.Linear(300, 260)))[0]  # 3 x 3 tiles, partial at the edges
    with torch.no_grad():
        layer.weight.copy_(fresh(260, 300, seed=11) * 1e-3)
    x = fresh(140, 300, seed=12).requires_grad_()
    g = fresh(140, 260, seed=13)
    with state.step(0):
        y = layer(x)
        y.backward(g)
    w = layer.weight.detach()
    close(y.detach() - layer.bias.detach(), dequantized(x, 1, 128, True), dequantized(w, 128, 128, True).t())
    close(x.grad, dequantized(g, 1, 128, True), dequantized(w, 128, 128, True))
    # the weight gradient: g and x in 128 x 1 tiles along the tokens
    close(layer.weight.grad, dequantized(g.t(), 1, 128, True), dequantized(x.t(), 1, 128, True).t())
    assert torch.equal(layer.bias.grad, g.sum(0))


def test_the_emulated_gemm_of_one_k_slice_is_its_formula_bitwise():
    a = fresh(48, 100, seed=14).to(E4M3)
    b = fresh(100, 200, seed=15).to(E4M3)
    da = torch.rand(48, 1, generator=torch.Generator().manual_seed(16)) + 0.5
    tiles = torch.rand(1, 200, generator=torch.Generator().manual_seed(17)) + 0.5
    blocks = torch.tensor([[0.75, 3.0]])  # b's two 128-wide column blocks
    bias = torch.randn(200, generator=torch.Generator().manual_seed(18))
    product = a.float() @ b.float()
    got = blockwise_matmul(a, b, da, tiles, torch.float32, "emulated", bias)
    assert bitwise_equal(got, product * (da * tiles) + bias)
    got = blockwise_matmul(a, b, da, blocks, torch.bfloat16, "emulated")
    want = product * (da * blocks.repeat_interleave(128, 1)[:, :200])
    assert bitwise_equal(got, want.to(torch.bfloat16))


def test_the_gemm_output_takes_its_bias_in_float32_rounded_once_in_one_pass():
    """The block-scaled GEMM writes bfloat16; the bias is added in float32 and rounded once, in
    place (one pass over the output, not a float32 copy, an add and a copy back)."""
    out = fresh(96, 384, seed=19).to(torch.bfloat16)
    for bias_dtype in (torch.float32, torch.bfloat16):
        bias = (fresh(1, 384, seed=20)[0] * 50).to(bias_dtype)
        for out_dtype in (torch.bfloat16, torch.float32):
            want = (out.float() + bias.float()).to(out_dtype)
            given = out.clone()
            got = _widened_with_bias(given, bias, out_dtype)
            assert got.dtype == out_dtype and bitwise_equal(got, want), (bias_dtype, out_dtype)
            if out_dtype == torch.bfloat16:
                assert got.data_ptr() == given.data_ptr()  # in place: no float32 copy of the output
    assert _widened_with_bias(out, None, torch.bfloat16) is out


def test_the_telemetry_reports_the_tiles_scales_and_the_largest_amax():
    state = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_blockwise", backward_format="e4m3"))
    layer = state.convert(nn.Sequential(nn.Linear(256, 8)))[0]
    x = fresh(4, 256, seed=19)
    with state.step(0):
        phase, record = state.protocol.enter_call("probe", ("input",), x.device)
        _, snap = state.protocol.quantize(record, "input", x, phase)
        layer(x).sum().backward()
    fields = recipe_for(state.config).telemetry(snap)
    amax = x.abs().reshape(4, 2, 128).amax(-1)
    assert fields["amax"] == amax.max()
    scale = torch.full_like(amax, 448.0) / amax  # (a Python number over a tensor is a reciprocal times it)
    assert fields["scale_min"] == scale.min() and fields["scale_max"] == scale.max()
