"""The RMSNorm and SwiGLU prologues (fused into the next Fp8Linear's input quantize), on the CPU.

The CPU runs the reference ops, so the whole path is exercised here; the kernels are checked
against the same references bit for bit on the GPU (tests/ops/test_cuda_rms_swiglu.py). Here:
the references against float64 math and their documented differences to Hugging Face's and
torch's formulas (measured), the reduction order against a scalar walk, the fused ops against
the quantized reference output bit for bit, the Linear with a prologue against the unfused
composition bit for bit (forward, records and gradients), the gradients against autograd of the
formula, the recompute audited under checkpointing, torch.compile, the fallbacks and the
argument errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state import encoders, ops
from lightning_fp8state.config import ConfigError
from lightning_fp8state.nn import Fp8Linear, linear_after, register_rms_norm
from lightning_fp8state.ops import reference_rms as rms_ref
from lightning_fp8state.ops import reference_swiglu as swiglu_ref
from tests.conftest import bitwise_equal
from tests.unit.test_compile import _assert_same_run, _train
from tests.unit.test_prologue import scalar_row_sum

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps


def rows(m: int, d: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Fresh rows of several magnitudes (every 7th row 50 times larger)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g) * 3.0 + 0.5
    x[::7] *= 50.0
    return x.to(dtype)


def norm_weight(d: int, seed: int = 1) -> torch.Tensor:
    return 1.0 + 0.3 * torch.randn(d, generator=torch.Generator().manual_seed(seed))


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (16-bit) dtype lie between a and b (same signs)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


# -- the RMSNorm reference -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_close_to_float64(dtype):
    x, w = rows(64, 256, dtype), norm_weight(256)
    y, rstd = rms_ref.rms_norm_reference(x, w, 1e-6)
    xd = x.double()
    want_rstd = 1.0 / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert y.dtype == dtype and y.shape == x.shape and rstd.shape == (64, 1) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd.double(), want_rstd, rtol=3 * EPS32, atol=0)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), xd * want_rstd * w.double(), rtol=tol, atol=tol * 1e-3)


@pytest.mark.parametrize(
    "d,dtype", [(4, torch.float32), (260, torch.float32), (2052, torch.float32), (264, torch.bfloat16)]
)
def test_rms_norm_rstd_is_the_kernels_row_sum_order(d, dtype):
    """rstd = 1 / sqrt(sum(x*x) / d + eps), the sum walked thread by thread as the kernel sums."""
    x = rows(3, d, dtype, seed=d)
    x[0, : d // 2] = 0.0  # zero partial sums
    _, rstd = rms_ref.rms_norm_reference(x, None, 1e-5)
    width = 16 // x.element_size()
    f = np.float32
    for r in range(3):
        row = x[r].float().numpy()
        total = scalar_row_sum((row * row).astype(np.float32), width)
        ms = f(total / f(d))
        root = f(np.sqrt(np.float64(f(ms + f(1e-5)))))
        assert rstd[r, 0].numpy().tobytes() == f(f(1.0) / root).tobytes(), f"row {r}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_against_hugging_face_and_torch(dtype):
    """What the fused RMSNorm gives up, measured: its rstd is within 2 ulp of torch's
    ``rsqrt(mean(x^2) + eps)`` (another summation order; a division); float32 y within about 3
    ulp of Hugging Face's (about a fifth of the elements differ); with a weight in x's 16-bit
    dtype, y is Hugging Face's bits but for one or two units in the last place on a few elements
    in ten thousand, where rstd's last bit turns the first rounding (the weight's product can
    carry that unit into a second). torch's nn.RMSNorm rounds once, after the weight:
    in 16 bits about a quarter of its elements are one unit off ours."""
    d = 2048
    x, w = rows(256, d, dtype, seed=3), norm_weight(d).to(dtype)
    y, rstd = rms_ref.rms_norm_reference(x, w.float(), 1e-6)
    torch_rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert ((rstd - torch_rstd).abs() / torch_rstd).max() <= 2 * EPS32
    hf = hf_rms_norm(x, w, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(y, hf, rtol=4 * EPS32, atol=0)
        assert 0.05 < (y != hf).float().mean() < 0.5  # the rounding of rstd shows in many elements
        return
    differ = y != hf
    assert differ.float().mean() < 0.001 and (ulps_apart(y[differ], hf[differ]) <= 2).all()
    torch_rms = nn.RMSNorm(d, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        torch_rms.weight.copy_(w)
        assert 0.1 < (y != torch_rms(x)).float().mean() < 0.5


def test_rms_norm_unfused_is_hugging_face_and_nn_rmsnorm_in_float32():
    x, w = rows(16, 30), norm_weight(30)
    y, rstd = rms_ref.rms_norm_unfused(x, w, 1e-6)
    assert torch.equal(y, hf_rms_norm(x, w, 1e-6)) and rstd.shape == (16, 1)
    torch_rms = nn.RMSNorm(30, eps=1e-6)
    with torch.no_grad():
        torch_rms.weight.copy_(w)
        assert torch.equal(y, torch_rms(x))


# -- the SwiGLU reference ----------------------------------------------------------------------


def test_exp_f32_close_to_float64_and_its_edges():
    v = torch.linspace(-110.0, 95.0, 400_001)
    got, want = swiglu_ref.exp_f32(v).double(), torch.exp(v.double())
    normal = (want > 2.0**-126) & (want < 3.4e38)
    assert ((got - want).abs() / want)[normal].max() <= 2 * EPS32  # measured: 0.74
    sub = want <= 2.0**-126
    assert ((got - want).abs()[sub] <= 2.0**-149).all()  # subnormals: within one step of the grid
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.72, 88.73, -104.0])
    out = swiglu_ref.exp_f32(specials)
    assert torch.isnan(out[0]) and out[1] == float("inf") and out[2] == 0.0 and out[3] == 1.0 and out[4] == 1.0
    assert torch.isfinite(out[5]) and out[6] == float("inf") and out[7] == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_reference_close_to_float64_and_to_torch(dtype):
    """silu(g) * u in float32 within about 2 ulp of float64 in every dtype; torch's
    ``F.silu(g) * u`` rounds silu and the product to the dtype, so the 16-bit results differ by
    that rounding (ours is rounded once, to FP8)."""
    h = (torch.randn(512, 2 * 384, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    y = swiglu_ref.swiglu_f32(h)
    g, u = h.double().chunk(2, dim=-1)
    want = F.silu(g) * u
    assert y.dtype == torch.float32 and y.shape == (512, 384)
    assert ((y.double() - want).abs() / want.abs().clamp(min=1e-300)).max() <= 3 * EPS32
    gate, up = h.chunk(2, dim=-1)
    theirs = F.silu(gate) * up
    if dtype == torch.float32:
        assert ((y - theirs).abs() / theirs.abs().clamp(min=1e-30)).max() <= 4 * EPS32
    else:
        torch.testing.assert_close(y.to(dtype), theirs, rtol=2 * torch.finfo(dtype).eps, atol=1e-5)
    h[0, 0], h[1, 0], h[2, 0] = float("nan"), float("inf"), -float("inf")
    y = swiglu_ref.swiglu_f32(h)
    assert torch.isnan(y[0, 0]) and y[1, 0] == float("inf") * h[1, 384].float() and torch.isnan(y[2, 0])


def test_backward_references_match_autograd_of_the_formulas():
    x, w = rows(48, 128, seed=5), norm_weight(128)
    dy = torch.randn(48, 128, generator=torch.Generator().manual_seed(6))
    _, rstd = rms_ref.rms_norm_reference(x, w, 1e-6)
    dx, dw = rms_ref.rms_norm_backward_reference(dy, x, rstd, w, (True, True))
    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd).backward(dy.double())
    torch.testing.assert_close(dx.double(), xd.grad, rtol=1e-5, atol=1e-6 * xd.grad.abs().max().item())
    torch.testing.assert_close(dw.double(), wd.grad, rtol=1e-5, atol=1e-6 * wd.grad.abs().max().item())
    h = torch.randn(48, 2 * 96, generator=torch.Generator().manual_seed(7)) * 3
    gy = torch.randn(48, 96, generator=torch.Generator().manual_seed(8))
    dh = swiglu_ref.swiglu_backward_reference(gy, h)
    hd = h.double().requires_grad_(True)
    g, u = hd.chunk(2, dim=-1)
    (F.silu(g) * u).backward(gy.double())
    torch.testing.assert_close(dh.double(), hd.grad, rtol=1e-5, atol=1e-6 * hd.grad.abs().max().item())


# -- the ops: the quantized reference output, bit for bit ------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_fused_ops_are_the_quantized_reference_output_bitwise(dtype, fp8):
    x, w, s = rows(37, 264, dtype, seed=9), norm_weight(264), torch.tensor([3.0])
    x[5, 7] = float("nan")
    pending = torch.full((3,), 1e-3)
    q, rstd = ops.rms_norm_quantize_fp8(x, w, 1e-6, s, fp8, pending, 1)
    y, want_rstd = rms_ref.rms_norm_reference(x, w, 1e-6)
    assert bitwise_equal(q, ops.quantize_fp8_reference(y, s, fp8)) and bitwise_equal(rstd, want_rstd)
    assert torch.isnan(pending[1]) and pending[0] == pending[2] == torch.tensor(1e-3)
    assert bitwise_equal(ops.rms_norm_quantize_fp8(x, w, 1e-6, s, fp8)[0], q)
    h = (torch.randn(3, 5, 2 * 75, generator=torch.Generator().manual_seed(10)) * 4).to(dtype)
    q = ops.swiglu_quantize_fp8(h, s, fp8, pending, 2)
    y = swiglu_ref.swiglu_f32(h)
    assert q.shape == (3, 5, 75) and bitwise_equal(q, ops.quantize_fp8_reference(y, s, fp8))
    assert bitwise_equal(pending[2], torch.maximum(torch.tensor(1e-3), y.abs().amax()))
    # the prologue's materialized output is what the fused op encodes (the calibration reads it)
    assert bitwise_equal(ops.quantize_fp8(encoders.Prologue("swiglu").apply(h), s, fp8), q)


def test_opcheck_on_cpu():
    x, w, s, pending = rows(8, 64), norm_weight(64), torch.tensor([2.0]), torch.zeros(2)
    h, gy = torch.randn(8, 2 * 20), torch.randn(8, 20)
    _, rstd = rms_ref.rms_norm_reference(x, w, 1e-6)
    fp8state = torch.ops.fp8state
    torch.library.opcheck(fp8state.rms_norm_quantize_fp8.default, (x, w, 1e-6, s, E4M3))
    torch.library.opcheck(fp8state.rms_norm_quantize_fp8_record_amax.default, (x, None, 1e-6, s, pending, 1, E4M3))
    torch.library.opcheck(fp8state.rms_norm_backward.default, (x, x, rstd, w, [True, True]))
    torch.library.opcheck(fp8state.rms_norm_backward.default, (x, x, rstd, None, [True, False]))
    torch.library.opcheck(fp8state.swiglu_quantize_fp8.default, (h, s, E5M2))
    torch.library.opcheck(fp8state.swiglu_quantize_fp8_record_amax.default, (h, s, pending, 0, E4M3))
    torch.library.opcheck(fp8state.swiglu_backward.default, (gy, h))


BAD_CALLS = {  # (call, the message it raises), the same on the GPU (tests/ops/test_cuda_rms_swiglu.py)
    "x.shape[-1]": (
        lambda t: ops.rms_norm_quantize_fp8(t(2, 30), None, 1e-6, t(1), E4M3),
        "x.shape[-1]=30 is not allowed: expected a positive multiple of 4 up to 8192 for torch.float32",
    ),
    "eps": (
        lambda t: ops.rms_norm_quantize_fp8(t(2, 32), None, -1e-06, t(1), E4M3),
        "eps=-1e-06 is not allowed: expected >= 0",
    ),
    "weight.shape": (
        lambda t: ops.rms_norm_quantize_fp8(t(2, 32), t(31), 1e-6, t(1), E4M3),
        "weight.shape=(31,) is not allowed: expected (32,) (one value per channel of x)",
    ),
    "weight.dtype": (
        lambda t: ops.rms_norm_quantize_fp8(t(2, 32), t(32).double(), 1e-6, t(1), E4M3),
        "weight.dtype=torch.float64 is not allowed: expected torch.float32",
    ),
    "rstd.numel()": (
        lambda t: ops.rms_norm_backward(t(4, 32), t(4, 32), t(3, 1), None, (True, True)),
        "rstd.numel()=3 is not allowed: expected 4 (one per row of x)",
    ),
    "h.shape[-1]": (
        lambda t: ops.swiglu_quantize_fp8(t(2, 7), t(1), E4M3),
        "h.shape[-1]=7 is not allowed: expected a positive even number (gate and up halves)",
    ),
    "h.dtype": (
        lambda t: ops.swiglu_quantize_fp8(t(2, 8).double(), t(1), E4M3),
        "h.dtype=torch.float64 is not allowed: expected one of [torch.float32, torch.bfloat16, torch.float16]",
    ),
    "grad_y.shape": (
        lambda t: ops.swiglu_backward(t(2, 4), t(2, 6)),
        "grad_y.shape=(2, 4) is not allowed: expected (2, 3)",
    ),
    "slot": (
        lambda t: ops.swiglu_quantize_fp8(t(2, 8), t(1), E4M3, t(2), 2),
        "slot=2 is not allowed: expected 0 <= slot < 2",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_op_arguments_raise_the_one_message(name):
    call, message = BAD_CALLS[name]
    with pytest.raises(ValueError) as info:
        call(lambda *shape: torch.ones(*shape))
    assert str(info.value) == message


# -- the Linear with the prologue --------------------------------------------------------------


def make_model(d_in: int, d_out: int, *, swiglu: bool = False, **quant):
    """An Fp8Linear (``lin``) after an ``nn.RMSNorm`` (``norm``): ``lin`` takes ``d_in``, or half
    of a SwiGLU input's ``2 * d_in``."""
    state = f8s.Fp8State(f8s.QuantConfig(gemm="emulated", **quant))
    torch.manual_seed(0)
    norm = nn.RMSNorm(d_in, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    model = nn.ModuleDict({"lin": nn.Linear(d_in, d_out), "norm": norm})
    state.convert(model)
    return state, model


def run(state, model, x, steps: int = 2, **kw):
    """``steps`` training events of ``linear_after(lin, x, **kw)``: the last event's output,
    input gradient, parameter gradients, and the amax records committed."""
    for step in range(steps):
        xg = x.clone().requires_grad_(True)
        with state.step(step, 0):
            y = linear_after(model["lin"], xg, **kw)
            state.commit_forward()
            y.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return y.detach(), xg.grad, grads, state.protocol.bank.amax_history.clone()


def test_linear_after_rms_norm_is_the_composition_bitwise():
    """The fused Linear against the same Linear fed the reference RMSNorm's output: the same
    codes, outputs, records and Linear gradients; the input's gradient is the reference backward
    of the composition's, bit for bit (and close to autograd of the formula)."""
    x = rows(6, 64, seed=11).reshape(2, 3, 64)
    state, model = make_model(64, 32, initial_scale="one")
    fused = run(state, model, x, norm=model["norm"])
    state_c, model_c = make_model(64, 32, initial_scale="one")
    w = model_c["norm"].weight
    y, rstd = rms_ref.rms_norm_reference(x, w, 1e-6)
    comp = run(state_c, model_c, y)
    assert bitwise_equal(fused[0], comp[0]) and bitwise_equal(fused[3], comp[3])
    for name in ("lin.weight", "lin.bias"):
        assert bitwise_equal(fused[2][name], comp[2][name]), name
    dx, dw = rms_ref.rms_norm_backward_reference(comp[1], x, rstd, w, (True, True))
    assert bitwise_equal(fused[1], dx) and bitwise_equal(fused[2]["norm.weight"], dw)
    xd, wd = x.double().requires_grad_(True), w.detach().double().requires_grad_(True)
    (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd).backward(comp[1].double())
    torch.testing.assert_close(fused[1].double(), xd.grad, rtol=1e-5, atol=1e-6 * xd.grad.abs().max().item())
    torch.testing.assert_close(dw.double(), wd.grad, rtol=1e-5, atol=1e-6 * wd.grad.abs().max().item())


def test_rms_norm_default_eps_and_no_weight():
    """``nn.RMSNorm(d)`` (eps None: float32's epsilon, as torch adds for every dtype it takes;
    no affine): the fused call is the composition with that eps, bit for bit."""
    x = rows(5, 32, seed=16) * 1e-4  # small: the epsilon shows
    state, model = make_model(32, 8, initial_scale="one")
    model["norm"] = nn.RMSNorm(32, elementwise_affine=False)
    fused = run(state, model, x, norm=model["norm"])
    state_c, model_c = make_model(32, 8, initial_scale="one")
    comp = run(state_c, model_c, rms_ref.rms_norm_reference(x, None, EPS32)[0])
    assert bitwise_equal(fused[0], comp[0]) and bitwise_equal(fused[3], comp[3])
    assert "norm.weight" not in fused[2]


def test_linear_after_swiglu_is_the_composition_bitwise():
    h = torch.randn(2, 3, 2 * 40, generator=torch.Generator().manual_seed(12)) * 2
    state, model = make_model(40, 16)
    fused = run(state, model, h, activation="swiglu")
    state_c, model_c = make_model(40, 16)
    comp = run(state_c, model_c, swiglu_ref.swiglu_f32(h))  # (calibrated on the same float32 product)
    assert bitwise_equal(fused[0], comp[0]) and bitwise_equal(fused[3], comp[3])
    for name in ("lin.weight", "lin.bias"):
        assert bitwise_equal(fused[2][name], comp[2][name]), name
    assert fused[1].shape == h.shape and bitwise_equal(fused[1], swiglu_ref.swiglu_backward_reference(comp[1], h))
    hd = h.double().requires_grad_(True)
    gate, up = hd.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(comp[1].double())
    torch.testing.assert_close(fused[1].double(), hd.grad, rtol=1e-5, atol=1e-6 * hd.grad.abs().max().item())
    assert set(fused[2]) == {"lin.weight", "lin.bias"}  # the norm is not in the swiglu call


@pytest.mark.parametrize("kind", ["rms_norm", "swiglu"])
def test_unfused_paths_stay_close_and_the_bf16_recipe_is_the_plain_model(kind):
    """fuse_prologues=False and a recipe that fuses nothing (fp8_current) run the model's own ops
    (nn.RMSNorm, F.silu(gate) * up), then quantize: close to the fused run; the bf16 recipe is the
    plain composition bit for bit."""
    d = 48
    x = rows(8, 2 * d if kind == "swiglu" else d, seed=13) / 8
    kw = {"activation": "swiglu"} if kind == "swiglu" else {}
    outs = []
    for quant in ({}, {"fuse_prologues": False}, {"recipe": "fp8_current"}):
        state, model = make_model(d, 16, **quant)
        outs.append(run(state, model, x, **kw, **({"norm": model["norm"]} if kind == "rms_norm" else {})))
    for other in outs[1:]:
        torch.testing.assert_close(other[0], outs[0][0], rtol=0.1, atol=0.1)
        torch.testing.assert_close(other[1], outs[0][1], rtol=0.1, atol=0.1)
    state, model = make_model(d, 16, recipe="bf16")
    with state.step(0, 0), torch.no_grad():
        got = linear_after(model["lin"], x, **kw, **({"norm": model["norm"]} if kind == "rms_norm" else {}))
        inner = encoders.swiglu(x) if kind == "swiglu" else model["norm"](x)
        assert torch.equal(got, F.linear(inner, model["lin"].weight, model["lin"].bias))


def test_rms_norm_width_without_a_kernel_runs_torchs_reductions():
    """30 is not a whole number of 4-float chunks: the prologue runs the RMSNorm in torch's
    reductions (nn.RMSNorm's float32 bits), then the quantize; its forward equals the unfused
    module's bit for bit, the gradients within float32 rounding."""
    x = rows(6, 30, seed=14)
    fused = run(*(sm := make_model(30, 8)), x, norm=sm[1]["norm"])
    unfused = run(*(su := make_model(30, 8, fuse_prologues=False)), x, norm=su[1]["norm"])
    assert bitwise_equal(fused[0], unfused[0]) and bitwise_equal(fused[3], unfused[3])
    torch.testing.assert_close(fused[1], unfused[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[2]["norm.weight"], unfused[2]["norm.weight"], rtol=1e-5, atol=1e-6)


class _HfStyleRMSNorm(torch.nn.Module):
    """A user's own Hugging Face style RMSNorm (LlamaRMSNorm's forward), unknown until registered."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def test_a_16_bit_weight_and_a_registered_rms_norm_class():
    """A bf16 model's RMSNorm weight is given to the kernel as float32 and its gradient comes
    back in bf16; a Hugging Face style RMSNorm class fuses once registered, as nn.RMSNorm does
    (the bundled Llama's registers itself)."""
    from lightning_fp8state.models.llama import RMSNorm  # noqa: PLC0415

    assert encoders.norm_kind(RMSNorm(64, 1e-6)) == "rms_norm"
    x = rows(4, 64, torch.bfloat16, seed=15)
    state, model = make_model(64, 8)
    model.bfloat16()
    out, dx, grads, _ = run(state, model, x, norm=model["norm"])
    assert out.dtype == dx.dtype == grads["norm.weight"].dtype == torch.bfloat16
    w = model["norm"].weight
    assert dx.shape == x.shape and torch.isfinite(dx).all()
    user_norm = _HfStyleRMSNorm(64, 1e-6).bfloat16()
    with torch.no_grad():
        user_norm.weight.copy_(w)
    assert encoders.norm_kind(user_norm) is None  # unknown: unfused, its own forward
    saved = list(encoders._RMS_NORM_TYPES)
    try:
        assert register_rms_norm(_HfStyleRMSNorm) is _HfStyleRMSNorm and encoders.norm_kind(user_norm) == "rms_norm"
        state_l, model_l = make_model(64, 8)
        model_l.bfloat16()
        model_l["norm"] = user_norm
        got = run(state_l, model_l, x, norm=user_norm)
        assert bitwise_equal(got[0], out) and bitwise_equal(got[1], dx)
        assert bitwise_equal(got[2]["norm.weight"], grads["norm.weight"])
    finally:
        encoders._RMS_NORM_TYPES[:] = saved


def test_arguments_are_checked_with_names():
    state, model = make_model(16, 8)
    lin, x = model["lin"], torch.randn(2, 16)
    assert isinstance(lin, Fp8Linear)
    with pytest.raises(ConfigError, match=r"activation='swiglu' is not allowed: .*takes norm or activation, not both"):
        linear_after(lin, x, norm=model["norm"], activation="swiglu")
    with pytest.raises(ConfigError, match=r"norm=LayerNorm\(.*\) is not allowed: expected an nn.RMSNorm"):
        lin(x, prologue="rms_norm", norm=nn.LayerNorm(16))
    with pytest.raises(ConfigError, match=r"norm=None is not allowed: expected an nn.RMSNorm"):
        lin(x, prologue="rms_norm")
    with pytest.raises(ConfigError, match=r"norm=RMSNorm\(.*\) is not allowed: expected an nn.LayerNorm"):
        lin(x, prologue="layer_norm", norm=model["norm"])
    with pytest.raises(ConfigError, match=r"cls=<class 'int'> is not allowed: expected an nn.Module subclass"):
        register_rms_norm(int)


# -- recompute under checkpointing, torch.compile ---------------------------------------------


class LlamaMLPBlock(nn.Module):
    """RMSNorm, a fused gate/up projection, SwiGLU, down: both prologues in one residual block."""

    def __init__(self, d: int = 32, inter: int = 40) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.gate_up = nn.Linear(d, 2 * inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.2)

    def forward(self, x):
        h = linear_after(self.gate_up, x, norm=self.norm)
        return x + linear_after(self.down, h, activation="swiglu")


@pytest.mark.parametrize("mode", ["safe", "naive"])
def test_recompute_through_both_prologues_is_audited(mode):
    """Safe: every recomputed call bit-identical to its forward; naive: the audit catches the
    defect through the fused path."""
    torch.manual_seed(0)
    blocks = nn.Sequential(LlamaMLPBlock(), LlamaMLPBlock())
    state = f8s.Fp8State(f8s.QuantConfig(gemm="emulated", mode=mode, strict=False))
    state.convert(blocks)
    x = torch.randn(2, 8, 32)
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(3):
            with state.step(step, 0):
                h = x
                for block in blocks:
                    h = f8s.checkpoint(block, h)
                loss = h.square().mean()
                state.commit_forward()
                loss.backward()
    report = auditor.report()
    assert report.recomputed > 0
    assert report.ok if mode == "safe" else report.mismatches


def _block():
    torch.manual_seed(0)
    model = LlamaMLPBlock()
    state = f8s.Fp8State(f8s.QuantConfig(mode="safe", strict=True))
    state.convert(model)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 8, 32, generator=g) * (1 + i), torch.randn(4, 8, 32, generator=g)) for i in range(3)]
    return model, state, data


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_compiled_block_is_one_graph_and_bitwise_the_eager_run(reentrant):
    """The fp8_linear op carries the RMSNorm's rstd in its statistics' slot and a SwiGLU's
    input twice as wide as its codes (the fakes say so): one graph (fullgraph), the eager bits."""
    eager = _train(*_block(), compiled=None, reentrant=reentrant)
    model, state, data = _block()
    compiled = _train(model, state, data, compiled="aot_eager", reentrant=reentrant)
    _assert_same_run(eager, compiled)
    assert not state.ledger.violations
