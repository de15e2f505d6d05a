"""Fused prologues (LayerNorm / GELU into the next Fp8Linear's input quantize), on the CPU.

The GPU kernels are checked bit for bit in tests/ops/test_cuda_fused.py; here: the reference's
reduction order against a scalar walk of the kernel's algorithm, the autograd of the fused
Linear against the unfused composition, the protocol's amax and calibration on the
prologue's output, the fallbacks, and the argument errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state import ops
from lightning_fp8state.config import ConfigError
from lightning_fp8state.nn import Fp8Linear, linear_after
from lightning_fp8state.ops import reference_fused as ref

E4M3 = torch.float8_e4m3fn


def scalar_row_sum(row: np.ndarray, width: int) -> np.float32:
    """The kernel's sum of one row, walked thread by thread in numpy float32 scalars."""
    threads, nchunks = ref.LN_THREADS, len(row) // width
    acc = [np.float32(0.0)] * threads
    for t in range(threads):
        c = t
        while c < nchunks:
            for e in range(width):
                acc[t] = np.float32(acc[t] + row[c * width + e])
            c += threads
    warps = [acc[w * 32 : (w + 1) * 32] for w in range(threads // 32)]
    sums = []
    for lanes in warps:
        for off in (16, 8, 4, 2, 1):
            lanes = [np.float32(lanes[i] + lanes[i ^ off]) for i in range(32)]
        assert len(set(lanes)) == 1  # the butterfly leaves every lane with the same bits
        sums.append(lanes[0])
    total = sums[0]
    for s in sums[1:]:
        total = np.float32(total + s)
    return total


@pytest.mark.parametrize(
    "d,width", [(4, 4), (12, 4), (96, 4), (260, 4), (1028, 4), (2048, 4), (2052, 4), (4096, 8), (64, 8), (24, 8)]
)
def test_reference_reduction_order_is_the_kernels(d, width):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, d, generator=g) * torch.tensor([[1.0], [1e3], [1e-3]])
    x[0, : d // 2] = -x[0, d // 2 : 2 * (d // 2)]  # exact cancellations: zero partial sums
    got = ref._row_sum(x, width)
    for r in range(3):
        want = scalar_row_sum(x[r].numpy().astype(np.float32), width)
        assert got[r].numpy().tobytes() == np.float32(want).tobytes(), f"row {r}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_layer_norm_close_to_torch(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 768, generator=g) * 5 + 2).to(dtype)
    w, b = torch.randn(768, generator=g), torch.randn(768, generator=g)
    y, mean, rstd = ref.layer_norm_reference(x, w, b, 1e-5)
    ty, tmean, trstd = torch.ops.aten.native_layer_norm(x.float(), [768], w, b, 1e-5)
    assert y.dtype == dtype and mean.shape == (16, 1)
    torch.testing.assert_close(y.float(), ty, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5)
    torch.testing.assert_close(mean, tmean) and torch.testing.assert_close(rstd, trstd)


def make_linear(d_in, d_out, **quant):
    state = f8s.Fp8State(f8s.QuantConfig(gemm="emulated", **quant))
    torch.manual_seed(0)
    lin = nn.Linear(d_in, d_out)
    norm = nn.LayerNorm(d_in)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
        norm.bias.normal_(0.0, 0.2)
    model = nn.ModuleDict({"lin": lin, "norm": norm})
    state.convert(model)
    return state, model


def run(state, model, x, step=0, **kw):
    x = x.clone().requires_grad_(True)
    with state.step(step, 0):
        y = linear_after(model["lin"], x, **kw)
        state.commit_forward()
        y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def test_fused_gelu_equals_unfused_bitwise_forward_and_backward():
    x = torch.randn(8, 5, 64) * 3
    fused = run(*make_linear(64, 32), x, activation="gelu")
    unfused = run(*make_linear(64, 32, fuse_prologues=False), x, activation="gelu")
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    for name in fused[2]:
        assert torch.equal(fused[2][name], unfused[2][name]), name


def test_fused_layer_norm_matches_unfused_and_trains_the_norm():
    x = torch.randn(8, 5, 64) * 3 + 1
    state, model = make_linear(64, 32)
    fused = run(state, model, x, norm=model["norm"])
    state_u, model_u = make_linear(64, 32, fuse_prologues=False)
    unfused = run(state_u, model_u, x, norm=model_u["norm"])
    # our LayerNorm rounds differently in the last float32 bits: a few codes may differ
    torch.testing.assert_close(fused[0], unfused[0], rtol=0.07, atol=0.05)
    torch.testing.assert_close(fused[1], unfused[1], rtol=0.07, atol=0.05)
    assert set(fused[2]) == {"lin.weight", "lin.bias", "norm.weight", "norm.bias"}
    for name in fused[2]:
        torch.testing.assert_close(fused[2][name], unfused[2][name], rtol=0.07, atol=0.05, msg=name)


def test_fallback_width_equals_unfused_bitwise():
    x = torch.randn(6, 30) * 2  # 30 is not a multiple of the 4-float chunk: no fused kernel
    state, model = make_linear(30, 16)
    fused = run(state, model, x, norm=model["norm"])
    state_u, model_u = make_linear(30, 16, fuse_prologues=False)
    unfused = run(state_u, model_u, x, norm=model_u["norm"])
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    for name in fused[2]:
        assert torch.equal(fused[2][name], unfused[2][name]), name


def test_recorded_amax_and_calibration_are_the_prologues_output():
    x = torch.randn(4, 64) * 1000.0  # LayerNorm brings it to ~N(0, 1): the input's amax is far off
    state, model = make_linear(64, 16)

    class Seen:  # an observer: the scale the first event's input was quantized with
        scales: list = []

        def observe(self, record, phase, output, snaps):
            self.scales.append(snaps["input"].scale.clone())

    state.protocol.auditors.append(Seen())
    run(state, model, x, norm=model["norm"])
    bank = state.protocol.bank
    (index,) = [i for i, o in enumerate(bank.owners) if o.role == "input"]
    y, _, _ = ref.layer_norm_reference(x, model["norm"].weight, model["norm"].bias, model["norm"].eps)
    amax = y.abs().amax()
    assert bank.amax_history[0, index] == amax  # the event's record, committed
    fmax = torch.finfo(E4M3).max
    # the first event was calibrated on the LayerNorm's output, not on x (materialized by
    # torch's LayerNorm for the calibration, so equal to the last bits or so)
    assert Seen.scales
    torch.testing.assert_close(Seen.scales[0].reshape(()), torch.tensor(fmax) / amax, rtol=1e-5, atol=0)


def test_gelu_record_is_max_abs_gelu():
    x = torch.randn(4, 64) * 3
    state, model = make_linear(64, 16)
    run(state, model, x, activation="gelu")
    bank = state.protocol.bank
    (index,) = [i for i, o in enumerate(bank.owners) if o.role == "input"]
    assert bank.amax_history[0, index] == F.gelu(x).abs().amax()


def test_plain_linear_and_hooked_norm_run_unfused():
    torch.manual_seed(0)
    lin, norm = nn.Linear(16, 8), nn.LayerNorm(16)
    x = torch.randn(3, 16)
    assert torch.equal(linear_after(lin, x, norm=norm), lin(norm(x)))
    assert torch.equal(linear_after(lin, x, activation="gelu"), lin(F.gelu(x)))
    state, model = make_linear(16, 8)
    calls = []
    model["norm"].register_forward_pre_hook(lambda m, a: calls.append(1))  # e.g. ZeRO-3's gather
    run(state, model, torch.randn(3, 16), norm=model["norm"])
    assert calls == [1]  # the module ran (unfused), so its hooks did


def test_bf16_recipe_applies_the_prologue():
    state = f8s.Fp8State(f8s.QuantConfig(recipe="bf16"))
    torch.manual_seed(0)
    model = nn.ModuleDict({"lin": nn.Linear(16, 8), "norm": nn.LayerNorm(16)})
    state.convert(model)
    x = torch.randn(3, 16)
    with state.step(0, 0):
        got = linear_after(model["lin"], x, norm=model["norm"])
        want = F.linear(model["norm"](x), model["lin"].weight, model["lin"].bias)
    assert torch.equal(got, want)


def test_arguments_are_checked_with_names():
    state, model = make_linear(16, 8)
    lin = model["lin"]
    assert isinstance(lin, Fp8Linear)
    x = torch.randn(2, 16)
    with pytest.raises(ConfigError, match=r"activation='gelu' is not allowed: .*takes norm or activation, not both"):
        linear_after(lin, x, norm=model["norm"], activation="gelu")
    with pytest.raises(ConfigError, match=r"activation='relu' is not allowed: expected one of \['gelu', 'swiglu'\]"):
        linear_after(lin, x, activation="relu")
    with pytest.raises(ConfigError, match=r"prologue='tanh' is not allowed: expected one of \[None, 'layer_norm'"):
        lin(x, prologue="tanh")
    with pytest.raises(ConfigError, match=r"norm=None is not allowed: expected an nn.LayerNorm"):
        lin(x, prologue="layer_norm")
    with pytest.raises(ConfigError, match=r"norm=LayerNorm\(.*\) is not allowed: expected None"):
        lin(x, norm=model["norm"])
    with pytest.raises(ConfigError, match="fuse_prologues"):
        f8s.QuantConfig(fuse_prologues="yes")
    s = torch.ones(1)
    with pytest.raises(ValueError, match=r"x\.shape\[-1\]"):
        ops.layer_norm_quantize_fp8(torch.randn(2, 30), None, None, 1e-5, s, E4M3)
    with pytest.raises(ValueError, match=r"bias\.shape"):
        ops.layer_norm_quantize_fp8(torch.randn(2, 32), None, torch.ones(31), 1e-5, s, E4M3)
    with pytest.raises(ValueError, match=r"weight\.dtype"):
        ops.layer_norm_quantize_fp8(torch.randn(2, 32), torch.ones(32, dtype=torch.float64), None, 1e-5, s, E4M3)


@pytest.mark.parametrize("mode", ["safe", "naive"])
def test_gpt_recompute_with_fused_prologues(mode):
    """Safe: every recomputed call bit-identical to its forward; naive: the audit still
    catches the defect through the fused path."""
    from lightning_fp8state.models import GPT, GPTConfig  # noqa: PLC0415

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=2, n_heads=4))
    state = f8s.Fp8State(f8s.QuantConfig(gemm="emulated", mode=mode, strict=False))
    state.convert(model)
    idx = torch.randint(0, 64, (2, 16))
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(3):
            with state.step(step, 0):
                loss = model.loss(idx, idx)
                state.commit_forward()
                loss.backward()
    report = auditor.report()
    assert report.recomputed > 0
    assert report.ok if mode == "safe" else report.mismatches


def test_naive_snapshot_mode_runs_the_fused_path():
    x = torch.randn(4, 64) * 3
    fused = run(*make_linear(64, 16, mode="naive_snapshot"), x, activation="gelu")
    unfused = run(*make_linear(64, 16, mode="naive_snapshot", fuse_prologues=False), x, activation="gelu")
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])


def test_inference_uses_the_prologue_too():
    x = torch.randn(4, 64) * 3
    outs = []
    for fuse in (True, False):
        state, model = make_linear(64, 16, fuse_prologues=fuse)
        run(state, model, x, activation="gelu")  # one training step: a committed scale
        with torch.no_grad():
            outs.append(linear_after(model["lin"], x, activation="gelu"))
    assert torch.equal(outs[0], outs[1])


def test_the_saturation_count_is_of_the_prologues_output():
    state, model = make_linear(64, 16)
    x = torch.randn(8, 64)
    run(state, model, x, norm=model["norm"])  # calibrated on LayerNorm outputs of ~N(0, 1)
    bank = state.protocol.bank
    (index,) = [i for i, o in enumerate(bank.owners) if o.role == "input"]
    before = bank.saturation[:, index].tolist()
    run(state, model, x * 1e4, step=1, norm=model["norm"])  # x itself would clamp nearly everywhere
    clipped, elements = (a - b for a, b in zip(bank.saturation[:, index].tolist(), before, strict=True))
    assert elements == x.numel()
    assert clipped <= x.numel() // 16  # the LayerNorm's output, not x, was counted


def test_opcheck_on_cpu():
    x = torch.randn(8, 64)
    w, b = torch.randn(64), torch.randn(64)
    s = torch.tensor([2.0])
    pending = torch.zeros(2)
    torch.library.opcheck(torch.ops.fp8state.gelu_quantize_fp8.default, (x, s, E4M3))
    torch.library.opcheck(torch.ops.fp8state.gelu_quantize_fp8_record_amax.default, (x, s, pending, 1, E4M3))
    torch.library.opcheck(torch.ops.fp8state.layer_norm_quantize_fp8.default, (x, w, b, 1e-5, s, E4M3))
    torch.library.opcheck(
        torch.ops.fp8state.layer_norm_quantize_fp8_record_amax.default, (x, None, b, 1e-5, s, pending, 0, E4M3)
    )


@pytest.mark.parametrize("d", [64, 66])  # 66: no fused kernel takes the width (torch's LayerNorm throughout)
def test_bf16_activations_beside_a_float32_norm(d):
    """An FSDP2 unit at ``param_dtype`` float32 fed the root's bf16 stream: the linear's input
    is bf16, the LayerNorm's affine float32. torch's LayerNorm takes no such mix ("expected
    scalar type BFloat16 but found Float": the first event's calibration, found on the H200 by
    ``benchmarks/fsdp_step.py``); the prologue runs it in float32, as autocast runs
    ``layer_norm``, and gives each gradient its operand's dtype."""
    state, model = make_linear(d, 16)
    norm = model["norm"]
    x = (torch.randn(6, d) * 3).bfloat16()
    # the torch path on its own, against F.layer_norm of the float32 activations, bitwise
    prologue = f8s.nn.Prologue.layer_norm(norm)
    xf = x.float().requires_grad_(True)
    want = F.layer_norm(xf, (d,), norm.weight, norm.bias, norm.eps)
    got = prologue.apply(x)
    assert got.dtype == torch.float32 and torch.equal(got, want.detach())
    grad_y = torch.randn(6, d)
    want_gx, want_gw, want_gb = torch.autograd.grad(want, (xf, norm.weight, norm.bias), grad_y)
    gx, gw, gb = prologue.backward(grad_y, x, prologue.stats, (True, True, True))
    assert gx.dtype == torch.bfloat16 and torch.equal(gx, want_gx.bfloat16())
    assert gw.dtype == gb.dtype == torch.float32 and torch.equal(gw, want_gw) and torch.equal(gb, want_gb)
    # through the linear: the first event calibrates on the prologue's output, and trains
    for step in range(2):
        y, gx, grads = run(state, model, x, step=step, norm=norm)
        assert y.dtype == gx.dtype == torch.bfloat16
        assert torch.isfinite(y.float()).all() and torch.isfinite(gx.float()).all()
        assert {n: g.dtype for n, g in grads.items()} == {n: torch.float32 for n in grads}
        assert set(grads) == {"lin.weight", "lin.bias", "norm.weight", "norm.bias"}


@pytest.mark.parametrize("d", [64, 66])
def test_bf16_activations_beside_a_float32_norm_compile_to_the_eager_result(d):
    """The same mix under torch.compile (the linear one op; its fake kernel gives torch's
    LayerNorm path the operands the real call gives it): outputs and gradients bitwise the
    eager run's, three events."""
    runs = {}
    for compiled in (False, True):
        state, model = make_linear(d, 16)
        norm = model["norm"]

        def f(x, lin=model["lin"], norm=norm):
            return linear_after(lin, x, norm=norm)

        fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
        out = []
        for step in range(3):
            x = (torch.randn(6, d, generator=torch.Generator().manual_seed(step)) * 3).bfloat16().requires_grad_(True)
            with state.step(step):
                y = fn(x)
                state.commit_forward()
                y.float().square().sum().backward()
            out.append([y.detach(), x.grad, *(p.grad.clone() for p in model.parameters())])
            model.zero_grad(set_to_none=True)
        runs[compiled] = out
    for eager, comp in zip(runs[False], runs[True], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(eager, comp, strict=True))
