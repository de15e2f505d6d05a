"""Recompute under autocast: every engine re-runs a region under its true forward's autocast state.

DeepSpeed's checkpoint does not save the autocast state (torch's does): before the region
wrapper restored it, a region checkpointed with ``engine="deepspeed"`` under ``torch.autocast``
recomputed its non-quantized ops in float32, so the quantized layers' inputs differed from the
true forward's (the auditor's ``operand_mismatches=['input']``) and so did the gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.recompute import AutocastState
from tests.conftest import ENGINE_IDS, ENGINES, bitwise_equal, event_inputs, make_stack

N_EVENTS = 4
AUTOCASTS = {
    "no-autocast": None,
    "cpu-bf16": ("cpu", torch.bfloat16),
}


def autocast_run(mode, ckpt, autocast, recipe="fp8_delayed"):
    """N events of the test stack, forward under ``autocast`` (backward outside it, as a
    training loop does); returns the audit report, outputs and gradients."""
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, recipe=recipe, strict=False))
    model = state.convert(make_stack(ckpt=ckpt))
    outs, grads = [], []
    with f8s.RecomputeAuditor(state) as auditor:
        for i, x in enumerate(event_inputs(N_EVENTS)):
            x = x.clone().requires_grad_(True)
            model.zero_grad(set_to_none=True)
            with state.step(i):
                ctx = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
                with ctx:
                    y = model(x)
                loss = y.float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            outs.append(y.detach().clone())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()} | {"x": x.grad.clone()})
    return auditor.report(), outs, grads


@pytest.mark.parametrize("autocast", AUTOCASTS.values(), ids=AUTOCASTS.keys())
@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("recipe", ["fp8_delayed", "bf16"])
def test_recompute_under_autocast_is_the_true_forward_bitwise(ckpt, autocast, recipe):
    report, outs_ck, grads_ck = autocast_run("safe", ckpt, autocast, recipe)
    assert report.recomputed >= 4 * N_EVENTS
    assert report.ok, report.format_table()
    _, outs_ref, grads_ref = autocast_run("safe", None, autocast, recipe)
    for event in range(N_EVENTS):
        assert bitwise_equal(outs_ref[event], outs_ck[event]), f"event {event}: output differs"
        for name, g in grads_ref[event].items():
            assert bitwise_equal(g, grads_ck[event][name]), f"event {event}: grad of {name} differs"


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_naive_mode_is_still_caught_under_autocast(ckpt):
    report, _, _ = autocast_run("naive", ckpt, AUTOCASTS["cpu-bf16"])
    assert not report.ok
    assert {"record_in_recompute", "second_commit"} <= {v.kind for v in report.violations}


def test_recompute_restores_an_autocast_the_forward_had_off():
    """A region whose true forward ran with autocast off recomputes with it off, even when the
    backward itself runs under autocast (state re-entered exactly, not only when enabled)."""
    seen = []

    def body(x):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return (x @ x.t()).sum(0)

    x = torch.randn(4, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        y = f8s.checkpoint(body, x, engine="deepspeed")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y.float().sum().backward()
    assert seen == [(False, torch.bfloat16), (False, torch.bfloat16)]


def test_autocast_state_captures_dtype_enabled_and_cache():
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        state = AutocastState.capture((torch.zeros(1),))
    cpu = dict((t, (e, d)) for t, e, d in state.devices)["cpu"]
    assert cpu == (True, torch.float16)
    assert state.cache_enabled is False
    assert torch.is_autocast_cache_enabled()  # left as it was
    with state.entered():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        assert not torch.is_autocast_cache_enabled()
    assert not torch.is_autocast_enabled("cpu")


def _grads_with_backward(inside: bool, recipe: str, backward_format: str, ckpt):
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe, backward_format=backward_format, strict=False))
    model = state.convert(make_stack(ckpt=ckpt))
    grads = []
    for i, x in enumerate(event_inputs(N_EVENTS)):
        x = x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        with state.step(i):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
                state.commit_forward()
                if inside:
                    loss.backward()
            if not inside:
                loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()} | {"x": x.grad.clone()})
    return grads


@pytest.mark.parametrize("ckpt", [None, ENGINES[0]], ids=["plain", ENGINE_IDS[0]])
@pytest.mark.parametrize(
    "recipe, backward_format",
    [("fp8_delayed", "e5m2"), ("fp8_current", "e5m2"), ("fp8_rowwise", "e4m3"), ("fp8_rowwise", "e5m2")],
)
def test_a_backward_called_inside_autocast_is_bitwise_one_called_outside(recipe, backward_format, ckpt):
    """The engine runs a backward under the autocast state of the code that called it. Fp8Linear's
    backward turns autocast off, as its forward does: its GEMMs (here the CPU's float32 emulation,
    and any GEMM that is not _scaled_mm on a GPU) keep their own precision. Before, a backward()
    inside the region ran them in bfloat16, and the compiled op (which turned it off) differed
    from the eager run (first seen on the H200 with fp8_rowwise's E5M2 gradients)."""
    outside = _grads_with_backward(False, recipe, backward_format, ckpt)
    inside = _grads_with_backward(True, recipe, backward_format, ckpt)
    for event, (a, b) in enumerate(zip(outside, inside, strict=True)):
        for name, g in a.items():
            assert bitwise_equal(g, b[name]), f"event {event}: grad of {name} differs"
