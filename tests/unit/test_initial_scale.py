"""The first event of an owner (no amax in its history yet): initial_scale="calibrate" takes
the scale from the call's own tensor, frozen like any scale; "one" keeps scale 1, where small
gradients flush to zero in E5M2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError
from tests.conftest import bitwise_equal, event_inputs, make_stack, run_events

FMAX = {"input": 448.0, "weight": 448.0, "grad_output": 57344.0}


class Snaps:
    """An auditor-shaped observer: every call's phase and snapshots, in order."""

    def __init__(self) -> None:
        self.calls = []

    def observe(self, record, phase, output, snaps):
        self.calls.append((record.layer, phase, dict(snaps)))


def tiny_gradient_event(initial_scale: str):
    """One step of a linear whose output gradient is ~1e-7: below E5M2's smallest subnormal
    (2**-16) at scale 1. Returns the FP8 weight gradient and the exact float32 one."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    ref = nn.Linear(64, 32, bias=False)
    ref.load_state_dict(lin.state_dict())
    state = f8s.Fp8State(f8s.QuantConfig(initial_scale=initial_scale))
    model = state.convert(nn.Sequential(lin))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g)
    weights = torch.randn(16, 32, generator=g) * 1e-7
    with state.step(0):
        loss = (model(x) * weights).sum()
        state.commit_forward()
        loss.backward()
    (ref(x) * weights).sum().backward()
    return model[0].weight.grad, ref.weight.grad


def test_scale_one_flushes_a_first_step_gradient_that_calibration_keeps():
    flushed, exact = tiny_gradient_event("one")
    assert torch.count_nonzero(flushed) == 0  # the defect "one" has: the first step learns nothing here
    kept, exact = tiny_gradient_event("calibrate")
    assert torch.count_nonzero(kept) == kept.numel()
    rel = (kept - exact).norm() / exact.norm()
    assert rel < 0.1, rel  # FP8 rounding of x, w and the gradient, not a lost gradient


def test_first_event_snapshot_holds_the_calls_own_scale_and_the_bank_advances_at_commit():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(nn.Sequential(nn.Linear(32, 16, bias=False)))
    obs = Snaps()
    state.protocol.auditors.append(obs)
    x = event_inputs(1, d=32)[0] * 7.0
    with state.step(0):
        y = model(x)
        (_, _, snaps) = obs.calls[0]
        owner = f8s.OwnerKey("0", "input")
        index = state.bank.index[owner]
        expected = torch.tensor(448.0) / x.abs().max()
        assert bitwise_equal(snaps["input"].scale.reshape(1), expected.reshape(1))
        assert bitwise_equal(snaps["input"].descale.reshape(1), torch.reciprocal(expected).reshape(1))
        assert state.bank.scale[index] == 1.0  # the bank is untouched until the commit
        assert index in state.bank.fresh
        state.commit_forward()
        assert index not in state.bank.fresh
        # a commit from a one-entry history computes the same scale the calibration did
        assert bitwise_equal(state.bank.scale[index].reshape(1), expected.reshape(1))
        y.float().pow(2).mean().backward()
    assert not state.bank.fresh  # every owner (input, weight, grad_output) committed once
    # the second event reads the delayed scale (history), not its own tensor
    obs.calls.clear()
    x2 = x * 3.0
    with state.step(1):
        model(x2)
        assert bitwise_equal(obs.calls[0][2]["input"].scale.reshape(1), expected.reshape(1))


@pytest.mark.parametrize("initial_scale", ["calibrate", "one"])
def test_first_event_recompute_is_bit_identical_to_the_true_forward(initial_scale):
    """Checkpointed blocks recompute in reverse order in event 0: they read the calibrated
    frozen scales back, bit for bit."""
    state = f8s.Fp8State(f8s.QuantConfig(ownership="per_layer", initial_scale=initial_scale))
    model = state.convert(make_stack(n=4, gains=[1.0, 8.0, 0.25, 30.0], ckpt=("torch", False)))
    obs = Snaps()
    state.protocol.auditors.append(obs)
    with f8s.RecomputeAuditor(state) as auditor, torch.utils.checkpoint.set_checkpoint_early_stop(False):
        run_events(state, model, event_inputs(2))
    report = auditor.report()
    assert report.ok, report.format_table()
    assert report.recomputed == 2 * 8  # every linear of every block, in both events
    first = [snaps["input"].scale.item() for _, phase, snaps in obs.calls[:16] if phase is f8s.Phase.FORWARD]
    assert len(first) == 8
    assert all(s != 1.0 for s in first) if initial_scale == "calibrate" else all(s == 1.0 for s in first)


def test_a_non_finite_first_tensor_calibrates_nothing():
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(nn.Sequential(nn.Linear(32, 16, bias=False)))
    obs = Snaps()
    state.protocol.auditors.append(obs)
    for bad in (float("nan"), float("inf"), float("-inf")):
        obs.calls.clear()
        x = event_inputs(1, d=32)[0]
        x[0, 3] = bad
        with torch.no_grad():  # inference: a private copy of the (fresh) live state
            model(x)
        assert obs.calls[0][2]["input"].scale.item() == 1.0, bad
        assert obs.calls[0][2]["weight"].scale.item() != 1.0  # the finite weight still calibrates
    x = event_inputs(1, d=32)[0]
    x[1, 0] = float("nan")
    with state.step(0):
        model(x).float().sum()
        state.commit_forward()
    index = state.bank.index[f8s.OwnerKey("0", "input")]
    assert state.bank.scale[index].item() == 1.0
    assert torch.count_nonzero(state.bank.amax_history[:, index]) == 0  # the history is not poisoned
    assert state.bank.nonfinite_count[index].item() == 1


def test_inference_before_training_calibrates_a_copy_and_leaves_the_bank_fresh():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(nn.Sequential(nn.Linear(32, 16, bias=False)))
    x = event_inputs(1, d=32)[0] * 5.0
    with torch.no_grad():
        y = model(x)
    index = state.bank.index[f8s.OwnerKey("0", "input")]
    assert index in state.bank.fresh and state.bank.scale[index].item() == 1.0
    assert torch.count_nonzero(state.bank.amax_history) == 0
    exact = x @ model[0].weight.t()
    assert ((y - exact).norm() / exact.norm()) < 0.1


def test_loaded_state_is_not_fresh_unless_its_history_is_empty():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(n=2))
    run_events(state, model, event_inputs(2))
    saved = state.state_dict()
    other = f8s.Fp8State(f8s.QuantConfig())
    other_model = other.convert(make_stack(n=2))
    other.load_state_dict(saved)
    assert other.bank.fresh == set()
    obs = Snaps()
    other.protocol.auditors.append(obs)
    x = event_inputs(3)[2] * 100.0
    with other.step(2):
        other_model(x)
    index = other.bank.index[f8s.OwnerKey("blocks.0.fc1", "input")]
    # the resumed run quantizes with the checkpoint's delayed scale, not one from x
    assert bitwise_equal(obs.calls[0][2]["input"].scale.reshape(1), saved["bank"]["scale"][index].reshape(1))

    # a bank saved before any commit: its owners are fresh again after loading
    empty = f8s.Fp8State(f8s.QuantConfig())
    empty_model = empty.convert(make_stack(n=2))
    with torch.no_grad():
        empty_model(event_inputs(1)[0])
    reloaded = f8s.Fp8State(f8s.QuantConfig())
    reloaded.load_state_dict(empty.state_dict())
    assert reloaded.bank.fresh == set(range(len(reloaded.bank)))


def test_initial_scale_is_validated():
    with pytest.raises(ConfigError, match="initial_scale='amax' is not allowed: expected one of"):
        f8s.QuantConfig(initial_scale="amax")


def test_calibrating_from_a_tensor_that_requires_grad_keeps_the_cells_out_of_autograd():
    from lightning_fp8state.state.bank import StateBank

    bank = StateBank(4)
    index = bank.register(f8s.OwnerKey("l", "input"), "e4m3", torch.device("cpu"))
    cells = torch.ones(2)
    x = (torch.randn(8, 8) * 3).requires_grad_(True)
    bank.calibrate(index, x * 2, cells[0], cells[1], margin=0)
    assert not cells.requires_grad and cells.grad_fn is None
    assert cells[0] == torch.tensor(448.0) / (x.detach() * 2).abs().max()
