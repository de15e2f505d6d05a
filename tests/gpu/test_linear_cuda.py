"""Fp8Linear on the GPU: recompute bit-identical with the CUDA kernels and torch._scaled_mm,
no host sync inside a training step, and the naive mode still caught."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.nn import gemm
from lightning_fp8state.state.bank import StateBank
from tests.conftest import bitwise_equal, make_stack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

D = 256


def cuda_inputs(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(64, D, device="cuda", generator=g, dtype=torch.bfloat16) * (1.5**i) for i in range(n)]


def run(mode, ckpt, xs, gemm_backend="auto"):
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False, gemm=gemm_backend))
    model = state.convert(make_stack(n=4, d=D, ckpt=ckpt)).cuda().bfloat16()
    outs, grads = [], []
    with f8s.RecomputeAuditor(state) as auditor:
        for i, x in enumerate(xs):
            x = x.clone().requires_grad_(True)
            model.zero_grad(set_to_none=True)
            with state.step(i):
                y = model(x)
                loss = y.float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            outs.append(y.detach())
            grads.append([p.grad.detach().clone() for p in model.parameters()])
    return state, auditor.report(), outs, grads


def test_kernels_loaded_and_scaled_mm_available():
    assert f8s.ops.cuda.ensure_loaded(), f8s.ops.cuda.extension_info()
    assert gemm.scaled_mm_available(torch.device("cuda")), torch.cuda.get_device_capability()


def test_scaled_mm_takes_scales_from_16_byte_cells_of_one_buffer():
    """What the frozen snapshot layout relies on (state/bank.py: one 16-byte cell per value):
    _scaled_mm accepts scale pointers at 16-byte offsets into one buffer, as in every event
    (found by hand on the H200, 2026-11-30: a 4-byte offset fails with CUBLAS_STATUS_NOT_SUPPORTED)."""
    a = torch.randn(64, 256, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(512, 256, device="cuda").to(torch.float8_e4m3fn).t()
    cells = torch.ones(64, device="cuda")
    reference = torch._scaled_mm(a, b, scale_a=cells[0], scale_b=cells[8], out_dtype=torch.bfloat16)
    for offset in (4, 12):  # 16 and 48 bytes
        out = torch._scaled_mm(a, b, scale_a=cells[offset], scale_b=cells[offset + 8], out_dtype=torch.bfloat16)
        assert bitwise_equal(out, reference)


def test_scaled_mm_path_is_taken(monkeypatch):
    calls = []
    real = torch._scaled_mm

    def counting(*a, **k):
        calls.append(a[0].dtype)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    run("safe", ("torch", False), cuda_inputs(1))
    assert calls and torch.float8_e5m2 in calls and torch.float8_e4m3fn in calls


@pytest.mark.parametrize(
    "ckpt",
    [("torch", False), ("torch", True), ("deepspeed", None)],
    ids=["torch-nonreentrant", "torch-reentrant", "deepspeed"],
)
def test_recompute_bit_identical_and_grads_equal_uncheckpointed_on_gpu(ckpt):
    if ckpt[0] == "deepspeed":
        pytest.importorskip("deepspeed", reason="deepspeed wheel not installed on this machine")
    xs = cuda_inputs(10)
    state, report, outs, grads = run("safe", ckpt, xs)
    assert report.ok and report.recomputed >= 40, report.format_table()
    _, _, outs_ref, grads_ref = run("safe", None, xs)
    for e in range(10):
        assert bitwise_equal(outs[e], outs_ref[e])
        assert all(bitwise_equal(a, b) for a, b in zip(grads[e], grads_ref[e], strict=True)), e
    _, naive, _, _ = run("naive", ckpt, xs)
    assert not naive.ok


@pytest.mark.parametrize(
    ("a_fmt", "b_fmt"), [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e4m3fn)]
)
def test_scaled_mm_agrees_with_the_emulation(a_fmt, b_fmt):
    """Same FP8 operands and descales through both backends. Hopper's FP8 tensor cores do
    not accumulate in full float32 (measured on the H200: normwise 1e-4 against the float32
    emulation), so float32 outputs agree to 5e-4; bf16 outputs to one rounding more."""
    g = torch.Generator(device="cuda").manual_seed(3)
    a = (torch.randn(128, 512, device="cuda", generator=g) * 4).to(a_fmt)
    b = (torch.randn(256, 512, device="cuda", generator=g) * 4).to(b_fmt).t()
    da = torch.full((4,), 0.03125, device="cuda")[0]
    db = torch.full((4,), 0.5, device="cuda")[0]
    bias = torch.randn(256, device="cuda", generator=g) * 8  # same order as the products
    for out_dtype, tol in ((torch.float32, 5e-4), (torch.bfloat16, 4e-3)):
        for bi in (None, bias):
            mm = gemm.scaled_matmul(a, b, da, db, out_dtype, backend="scaled_mm", bias=bi)
            em = gemm.scaled_matmul(a, b, da, db, out_dtype, backend="emulated", bias=bi)
            assert mm.dtype == em.dtype == out_dtype
            rel = (mm.float() - em.float()).norm() / em.float().norm()
            assert rel < tol, (out_dtype, bi is not None, rel)
    with_bias = gemm.scaled_matmul(a, b, da, db, torch.float32, backend="scaled_mm", bias=bias)
    without = gemm.scaled_matmul(a, b, da, db, torch.float32, backend="scaled_mm")
    torch.testing.assert_close(with_bias - without, bias.expand_as(without), rtol=0, atol=1e-3)


@pytest.mark.parametrize("k", [1, 37, 200])
def test_a_k_not_a_multiple_of_16_runs_scaled_mm_on_padded_codes(monkeypatch, k):
    """An expert's weight gradient has K = its share of the routed tokens, rarely a multiple of
    16: the per-tensor GEMM pads K with zero codes and stays on ``_scaled_mm`` (it fell back to
    the float32 emulation, ~5x slower than bf16 at Mixtral's expert shapes). Operands as the
    backward passes them: ``a`` the transposed view of grad_output's cast-transpose, ``b``
    row-major saved inputs."""
    from lightning_fp8state.quant_recipes import gemm as per_tensor

    g = torch.Generator(device="cuda").manual_seed(k)
    a = (torch.randn(k, 192, device="cuda", generator=g) * 4).to(torch.float8_e5m2).t()  # [192, k]
    b = (torch.randn(k, 256, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn)  # [k, 256]
    da, db = torch.tensor(0.25, device="cuda"), torch.tensor(0.125, device="cuda")
    want = per_tensor.scaled_matmul(a, b, da, db, torch.float32, backend="emulated")

    def refused(*args, **kw):
        raise AssertionError("the float32 emulation ran")

    monkeypatch.setattr(per_tensor, "_emulated", refused)
    got = per_tensor.scaled_matmul(a, b, da, db, torch.float32)
    assert got.shape == (192, 256)
    rel = (got - want).norm() / want.norm()
    assert rel < 5e-4, rel


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_out_is_written_in_place_with_the_bits_of_a_fresh_product(bias):
    """``scaled_matmul(out=)`` (the experts' weight gradient writes each expert's product into
    its slice of ``[E, out, in]``): the slice holds what a fresh product would, bit for bit, and
    the rest of the tensor is untouched."""
    from lightning_fp8state.quant_recipes import gemm as per_tensor

    g = torch.Generator(device="cuda").manual_seed(11)
    a = (torch.randn(192, 64, device="cuda", generator=g) * 4).to(torch.float8_e5m2)
    b = (torch.randn(256, 64, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn).t()
    da, db = torch.tensor(0.25, device="cuda"), torch.tensor(0.125, device="cuda")
    bi = torch.randn(256, device="cuda", generator=g) if bias else None
    for backend in ("auto", "emulated"):
        fresh = per_tensor.scaled_matmul(a, b, da, db, torch.bfloat16, backend, bias=bi)
        whole = torch.randn(3, 192, 256, device="cuda", generator=g).to(torch.bfloat16)
        before = whole.clone()
        got = per_tensor.scaled_matmul(a, b, da, db, torch.bfloat16, backend, bias=bi, out=whole[1])
        assert got.data_ptr() == whole[1].data_ptr()
        assert torch.equal(whole[1].view(torch.int16), fresh.view(torch.int16)), backend
        assert torch.equal(whole[0], before[0]) and torch.equal(whole[2], before[2])


def test_no_host_sync_inside_a_training_step():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(n=4, d=D, ckpt=("torch", False))).cuda().bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = cuda_inputs(4)

    def step(i):
        x = xs[i].clone().requires_grad_(True)
        with state.step(i):
            loss = model(x).float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)  # first step: owners register, masks are built (one-time host->device copies)
    step(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(2)
        step(3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert state.ledger.ok


def test_first_event_calibration_runs_on_the_device_without_a_host_sync():
    """StateBank.calibrate (an owner's first event, initial_scale="calibrate") for FP8, FP4 and
    centered FP4 owners, finite and non-finite tensors: no host sync, the reference formula."""
    bank = StateBank(4)
    owners = [f8s.OwnerKey(f"l{i}", "input") for i in range(3)]
    dev = torch.device("cuda")
    idx = [bank.register(owners[0], "e4m3", dev), bank.register(owners[1], "nvfp4", dev)]
    idx.append(bank.register(owners[2], "nvfp4", dev, center_width=D))
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(64, D, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    center = torch.randn(D, device="cuda", generator=g)
    bad = x.clone()
    bad[3, 7] = float("nan")
    cells = torch.ones(2, 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bank.calibrate(idx[0], x, cells[0, 0], cells[1, 0], margin=0)
        bank.calibrate(idx[1], x, cells[0, 1], cells[1, 1], margin=1)
        bank.calibrate(idx[2], x, cells[0, 2], cells[1, 2], margin=0, center=center)
        bank.calibrate(idx[0], bad, cells[0, 3], cells[1, 3], margin=0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    amax = x.float().abs().max()
    expected = torch.stack(
        [
            bank.fmax[idx[0]] / amax,  # (fmax = 448 for E4M3; a tensor division, as the bank does)
            bank.fmax[idx[1]] / amax / 2.0,
            bank.fmax[idx[2]] / (x.float() - center).abs().max(),
            torch.tensor(1.0, device="cuda"),
        ]
    )
    assert bitwise_equal(cells[0], expected.float())
    assert bitwise_equal(cells[1], torch.reciprocal(expected.float()))


def test_first_event_flushes_no_gradient_on_gpu():
    """bf16 on the GPU with _scaled_mm: a first-step output gradient of ~1e-7 reaches the
    weight gradient with initial_scale="calibrate"; with "one" it flushes to zero."""
    grads = {}
    for initial in ("calibrate", "one"):
        torch.manual_seed(0)
        state = f8s.Fp8State(f8s.QuantConfig(initial_scale=initial))
        model = state.convert(torch.nn.Sequential(torch.nn.Linear(D, D, bias=False))).cuda().bfloat16()
        x = cuda_inputs(1, seed=2)[0]
        w = torch.randn(64, D, device="cuda", dtype=torch.bfloat16) * 1e-7
        with state.step(0):
            loss = (model(x).float() * w.float()).sum()
            state.commit_forward()
            loss.backward()
        grads[initial] = model[0].weight.grad.float()
        exact = w.float().t() @ x.float()
    assert torch.count_nonzero(grads["one"]) == 0
    assert ((grads["calibrate"] - exact).norm() / exact.norm()) < 0.1
