"""The stateless recipes (issue 28): fp8_current, fp8_rowwise, fp8_rowwise_gw_hp.

Their reference quantize against a hand computation (numpy float32, torch's FP8 cast as the
format's rounding), the rowwise GEMM against the dequantized product, each call's own scale in
its snapshot, the auditor's input check and configs. What every recipe keeps (ownership,
stamps, the ledger, recompute, checkpoint refusal, the FSDP2 gather, graphs) is checked once
for all of them in test_recipe_conformance.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError, StaleSnapshotError
from lightning_fp8state.ops.library_dynamic import current_scale, quantize_fp8_current, quantize_fp8_rowwise
from lightning_fp8state.quant_recipes.rowwise import rowwise_matmul
from lightning_fp8state.telemetry.quantizer import quantizer_health
from tests.conftest import bitwise_equal, event_inputs, make_stack, run_events

STATELESS = ["fp8_current", "fp8_rowwise", "fp8_rowwise_gw_hp"]
N_EVENTS = 3
E4M3_MAX = np.float32(448.0)


def _codes_by_hand(v: np.ndarray, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    """FP8 codes of the float32 products ``v``: clamp, then the format's round-to-nearest-even
    (torch's cast), NaN as the canonical 0x7F."""
    t = torch.from_numpy(np.clip(v, -fmax, fmax).astype(np.float32)).to(dtype)
    bits = t.view(torch.uint8).clone()
    bits[torch.from_numpy(np.isnan(v))] = 0x7F
    return bits


def _scale_by_hand(amax: np.ndarray, fmax: np.float32) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        cand = (fmax / amax).astype(np.float32)  # margin 0: / 2**0 is exact
        ok = np.isfinite(amax) & (amax > 0) & np.isfinite(cand)
        return np.where(ok, cand, np.float32(1)), np.where(ok, (np.float32(1) / cand).astype(np.float32), 1)


def test_current_quantize_matches_a_hand_computation_on_fresh_random_data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(37, 53, generator=g) * 3.7
    q, scale, descale, amax = quantize_fp8_current(x, torch.float8_e4m3fn, 0)
    xn = x.numpy()
    want_amax = np.float32(np.max(np.abs(xn)))
    want_scale, want_descale = _scale_by_hand(np.array([want_amax], dtype=np.float32), E4M3_MAX)
    assert amax.item() == want_amax and scale.item() == want_scale[0] and descale.item() == want_descale[0]
    assert scale.dim() == 0 and scale.dtype == torch.float32
    want = _codes_by_hand(xn * want_scale[0], torch.float8_e4m3fn, 448.0)
    assert torch.equal(q.view(torch.uint8), want)
    # the largest magnitude lands on the format's max
    assert q.to(torch.float32).abs().max().item() == 448.0
    # current_scale is the same amax and scales without the codes (grad_output's first pass)
    assert [t.item() for t in current_scale(x, torch.float8_e4m3fn, 0)] == [scale.item(), descale.item(), amax.item()]


def test_rowwise_quantize_matches_a_hand_computation_per_row_with_the_guards():
    g = torch.Generator().manual_seed(99)
    x = torch.randn(9, 40, generator=g) * torch.logspace(-3, 3, 9).unsqueeze(1)  # rows of very different size
    x[2] = 0.0  # zero amax: scale 1
    x[4, 7] = float("inf")  # non-finite amax: scale 1, the row saturates
    x[6, 3] = float("nan")  # NaN row: scale 1, NaN stays the canonical code
    for dtype, fmax in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        q, scale, descale, amax = quantize_fp8_rowwise(x, dtype, 0)
        assert scale.shape == descale.shape == amax.shape == (9, 1)
        xn = x.numpy()
        with np.errstate(invalid="ignore"):
            row_amax = np.abs(xn).max(axis=1, keepdims=True).astype(np.float32)
        want_scale, want_descale = _scale_by_hand(row_amax, np.float32(fmax))
        assert np.array_equal(scale.numpy(), want_scale) and np.array_equal(descale.numpy(), want_descale)
        assert scale[2].item() == scale[4].item() == scale[6].item() == 1.0
        with np.errstate(invalid="ignore"):
            want = _codes_by_hand(xn * want_scale, dtype, fmax)
        assert torch.equal(q.view(torch.uint8), want)
    # margin: the scale of every finite row halves per step
    _, s1, _, _ = quantize_fp8_rowwise(x, torch.float8_e4m3fn, 1)
    _, s0, _, _ = quantize_fp8_rowwise(x, torch.float8_e4m3fn, 0)
    finite = torch.isfinite(x).all(1) & (x.abs().amax(1) > 0)
    assert torch.equal(s1[finite], s0[finite] / 2)


def test_rowwise_emulated_gemm_is_the_dequantized_product():
    g = torch.Generator().manual_seed(5)
    a, _, _, _ = quantize_fp8_rowwise(torch.randn(24, 32, generator=g), torch.float8_e4m3fn, 0)
    b, _, _, _ = quantize_fp8_rowwise(torch.randn(16, 32, generator=g), torch.float8_e4m3fn, 0)
    # power-of-two descales: dequantizing is exact, so the two orders agree bit for bit
    da = torch.exp2(torch.randint(-6, 6, (24, 1), generator=g).float())
    db = torch.exp2(torch.randint(-6, 6, (1, 16), generator=g).float())
    bias = torch.randn(16, generator=g)
    y = rowwise_matmul(a, b.t(), da, db, torch.float32, "emulated", bias)
    want = (a.float() * da) @ (b.t().float() * db) + bias
    assert bitwise_equal(y, want)
    # and any descales: the dequantized product within float32 rounding
    da, db = torch.rand(24, 1, generator=g) + 0.1, torch.rand(1, 16, generator=g) + 0.1
    y = rowwise_matmul(a, b.t(), da, db, torch.float64, "emulated")
    ref = (a.double() * da.double()) @ (b.t().double() * db.double())
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


def audited_run(recipe, ckpt, n_events=N_EVENTS, **cfg):
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe, **cfg))
    model = state.convert(make_stack(ckpt=ckpt))
    with f8s.RecomputeAuditor(state) as auditor:
        outs, grads = run_events(state, model, event_inputs(n_events))
    return state, auditor.report(), outs, grads


def test_the_recipes_differ_from_each_other_and_from_delayed():
    outs = {r: audited_run(r, None, n_events=2)[2:] for r in ("fp8_delayed", *STATELESS)}
    y = {r: o[0][1] for r, o in outs.items()}
    assert not bitwise_equal(y["fp8_delayed"], y["fp8_current"])
    assert not bitwise_equal(y["fp8_current"], y["fp8_rowwise"])
    # gw_hp: the same forward as rowwise, another weight gradient
    assert bitwise_equal(y["fp8_rowwise"], y["fp8_rowwise_gw_hp"])
    g_rw, g_hp = outs["fp8_rowwise"][1][1], outs["fp8_rowwise_gw_hp"][1][1]
    assert bitwise_equal(g_rw["x"], g_hp["x"])
    assert not bitwise_equal(g_rw["blocks.0.fc1.weight"], g_hp["blocks.0.fc1.weight"])


@pytest.mark.parametrize("recipe", STATELESS)
def test_snapshots_carry_the_calls_own_scale_and_stamps(recipe):
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe))
    layer = state.convert(nn.Sequential(nn.Linear(16, 8)))[0]
    x = torch.randn(6, 16) * 5
    with state.step(0):
        phase, record = state.protocol.enter_call("probe", ("input",), x.device)
        q, snap = state.protocol.quantize(record, "input", x, phase)
        assert snap.event == (0, 0) and snap.owner.layer == "probe" and snap.owner.role == "input"
        amax = x.abs().amax() if recipe == "fp8_current" else x.abs().amax(1, keepdim=True)
        assert torch.equal(snap.amax, amax) and torch.equal(snap.scale, torch.full_like(amax, 448.0) / amax)
        with pytest.raises(StaleSnapshotError, match="owner mismatch"):
            other = dataclasses.replace(snap, owner=dataclasses.replace(snap.owner, layer="elsewhere"))
            state.protocol.check_consumer(record, "input", other)
        layer(x).sum().backward()
    health, _ = quantizer_health(state)
    key = "scale" if recipe == "fp8_current" else "scale_max"
    assert health[f"fp8state/{key}/0.input"] > 0 and health["fp8state/amax/0.input"] == x.abs().max().item()


class _Drifting(nn.Module):
    """A block whose input drifts by one ulp of one small element on every call: the recompute
    sees an input that is not bitwise the true forward's, yet quantizes to the same codes and
    the same scale (the element is far from the amax and from any rounding boundary)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        bump = torch.zeros_like(x)
        bump[0, 0] = torch.finfo(torch.float32).eps * self.calls * x[0, 0].abs()
        return self.fc(x + bump)


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_rowwise"])
def test_the_auditor_flags_a_recompute_whose_input_is_not_the_forwards(recipe):
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe))
    block = state.convert(_Drifting())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    x[0, 0] = 0.3
    with f8s.RecomputeAuditor(state) as auditor:
        with state.step(0):
            f8s.checkpoint(block, x.requires_grad_(True), engine="torch", use_reentrant=False).sum().backward()
    report = auditor.report()
    assert not report.ok
    assert [r.operand_mismatches for r in report.mismatches] == [["input"]]
    row = report.mismatches[0]
    assert row.max_abs_diff == 0.0  # the same codes at the same scale: only the input tells


def test_config_names_the_allowed_recipes_and_refuses_naive_without_state():
    # QuantConfig holds a name; the registry beside the recipes checks it when a state is built
    with pytest.raises(ConfigError, match=r"recipe='fp8_tensorwise'.*'fp8_delayed'.*'fp8_current'.*'fp8_rowwise'"):
        f8s.Fp8State(f8s.QuantConfig(recipe="fp8_tensorwise"))
    with pytest.raises(ConfigError, match=r"mode='naive' is not allowed with recipe='fp8_current'.*\['safe'\]"):
        f8s.Fp8State(f8s.QuantConfig(recipe="fp8_current", mode="naive"))
    with pytest.raises(ConfigError, match=r"recipe="):
        f8s.QuantConfig(recipe="")
    assert f8s.QuantConfig.from_dict({"recipe": "fp8_rowwise_gw_hp"}).recipe == "fp8_rowwise_gw_hp"


# sha256 of fp8_delayed's outputs, gradients, scales and histories on this run, computed with
# the code before recipes were plug-ins (commit fbdaa06) on the CPU (torch 2.13): moving the
# delayed path into quant_recipes/ changed none of its bits. A torch upgrade that changes CPU
# matmul rounding changes it too: recompute it at fbdaa06 with the same torch then.
DELAYED_BEFORE_RECIPES = "654e962180f2423ce80a0819c6d0166ff848e8389bccfa4abd994d0c6ce7505c"


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="digest taken with torch 2.13's CPU kernels")
def test_fp8_delayed_is_bitwise_what_it_was_before_recipes():
    h = hashlib.sha256()
    for ckpt in (None, ("torch", False)):
        for kw in ({}, {"initial_scale": "one", "margin": 1, "amax_algo": "most_recent"}):
            state = f8s.Fp8State(f8s.QuantConfig(**kw))
            model = state.convert(make_stack(ckpt=ckpt))
            outs, grads = run_events(state, model, event_inputs(4))
            for o, g in zip(outs, grads, strict=True):
                h.update(o.numpy().tobytes())
                for n in sorted(g):
                    h.update(g[n].numpy().tobytes())
            h.update(state.bank.scale.numpy().tobytes())
            h.update(state.bank.amax_history.numpy().tobytes())
    assert h.hexdigest() == DELAYED_BEFORE_RECIPES


E4M3_ONLY = ["fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise", "fp8_blockwise_pow2"]


@pytest.mark.parametrize("recipe", E4M3_ONLY)
def test_rowwise_and_blockwise_with_an_e5m2_operand_warn_that_their_gemms_fall_back_to_float32(recipe):
    with pytest.warns(UserWarning, match=r"quant.backward_format='e5m2'.*E4M3 operands only"):
        f8s.Fp8State(f8s.QuantConfig(recipe=recipe, backward_format="e5m2"))
    with pytest.warns(UserWarning, match=rf"recipe='{recipe}'.*as configs/quant/{recipe}.yaml does"):
        f8s.Fp8State(f8s.QuantConfig(recipe=recipe, forward_format="e5m2"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f8s.Fp8State(f8s.QuantConfig(recipe=recipe, backward_format="e4m3"))  # as the shipped config: quiet


@pytest.mark.parametrize("recipe", E4M3_ONLY)
def test_a_recipe_named_alone_takes_its_own_formats_so_its_gemms_run_in_fp8(recipe, monkeypatch):
    """QuantConfig(recipe=...) alone: the recipe's formats (E4M3 gradients here), quiet, and the
    backward's GEMMs reach the FP8 GEMM with E4M3 operands (not the float32 path E5M2 takes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe))
    assert (state.config.forward_format, state.config.backward_format) == ("e4m3", "e4m3")
    module = importlib.import_module(f"lightning_fp8state.quant_recipes.{recipe.split('_')[1]}")
    mm = "blockwise_matmul" if "blockwise" in recipe else "rowwise_matmul"
    dtypes, real = [], getattr(module, mm)

    def spy(a, b, *args, **kwargs):
        dtypes.append((a.dtype, b.dtype))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(module, mm, spy)
    model = state.convert(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128)))
    with state.step(0):
        model(torch.randn(32, 256, requires_grad=True)).sum().backward()
    # forward and input gradient of both layers (and the weight gradients, but under gw_hp)
    assert len(dtypes) >= 4 and set(dtypes) == {(torch.float8_e4m3fn, torch.float8_e4m3fn)}, dtypes


def test_auto_formats_resolve_on_construction_and_an_explicit_format_wins():
    assert (f8s.QuantConfig().forward_format, f8s.QuantConfig().backward_format) == ("e4m3", "e5m2")
    assert f8s.QuantConfig(recipe="fp8_current").backward_format == "e5m2"
    assert f8s.QuantConfig(recipe="fp8_rowwise", backward_format="auto").backward_format == "e4m3"
    assert f8s.QuantConfig(recipe="fp8_rowwise", backward_format="e5m2").backward_format == "e5m2"
    assert f8s.QuantConfig(forward_format="e5m2").forward_format == "e5m2"
    # what a checkpoint keeps is the resolved name: the same config as one written out in full
    assert f8s.QuantConfig(recipe="fp8_blockwise") == f8s.QuantConfig(
        recipe="fp8_blockwise", forward_format="e4m3", backward_format="e4m3"
    )
    saved = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_rowwise")).state_dict()
    assert "auto" not in repr(saved)
    with pytest.raises(f8s.ConfigError, match=r"forward_format='e4m4' is not allowed: expected one of .*'auto'"):
        f8s.QuantConfig(forward_format="e4m4")


@pytest.mark.parametrize(
    "op", ["quantize_fp8_rowwise", "quantize_fp8_current", "current_scale", "quantize_fp8_colwise"]
)
def test_every_dynamic_op_wrapper_loads_the_kernels_before_dispatching(monkeypatch, op):
    """Before its first dispatch each wrapper asks ``ops.cuda.load_for`` to load the extension
    (on a CUDA tensor the reference would otherwise serve the call: tests/ops/test_cuda_dynamic.py)."""
    from lightning_fp8state.ops import cuda
    from lightning_fp8state.ops import library_dynamic as dyn

    seen = []
    monkeypatch.setattr(cuda, "load_for", seen.append)
    x = torch.randn(4, 32)
    getattr(dyn, op)(x, torch.float8_e4m3fn, 0)
    assert seen == [x]


def test_a_recipe_that_saves_its_inputs_cannot_fuse_prologues():
    """The compiled op's backward takes a saved input where a fused prologue's input goes."""
    from lightning_fp8state.quant_recipes.base import Recipe

    with pytest.raises(TypeError, match=r"saves_inputs=True needs fuses_prologues=False"):

        class _Both(Recipe):  # noqa: F841  (defining it is the test)
            name = "both"
            saves_inputs = True
            fuses_prologues = True
