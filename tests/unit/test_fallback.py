"""QuantConfig.fallback: a layer that FP8 fails on moves to high precision at an event's end.

The injected outlier layer: from step 3 on, ``fc1``'s weight holds one element of 1e37 and its
input one feature scaled by 1e8. Both are finite, and so is the high-precision product (the
outliers sit in different columns, and a tanh bounds what follows); but the FP8 GEMM multiplies
the two descales first (about 1e37/448 * 1e8/448 > float32's max), so once the delayed scales
have caught up with the outliers (step 4) fc1's FP8 output is inf/NaN and every gradient with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError, StateLoadError
from lightning_fp8state.telemetry import TrainingTelemetry
from lightning_fp8state.telemetry.report import summarize
from lightning_fp8state.telemetry.sinks import read_telemetry
from tests.conftest import bitwise_equal

STEPS, OUTLIER_STEP = 8, 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)
        self.register_buffer("gain", torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x * self.gain))))


def _inject(model: _Net) -> None:
    with torch.no_grad():
        model.fc1.weight[0, 0] = 1e37
        model.gain[1] = 1e8


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(64, 32, generator=g) for _ in range(STEPS)]


def _fresh(fallback: bool):
    torch.manual_seed(0)
    model = _Net()
    state = f8s.Fp8State(f8s.QuantConfig(fallback=fallback))
    state.convert(model)
    return state, model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _train(state, model, opt, steps, *, telemetry=None) -> list[int]:
    """Train ``steps``; returns the steps whose gradients were not all finite (skipped)."""
    skipped = []
    for step in steps:
        if step == OUTLIER_STEP:
            _inject(model)
        x = _batches()[step]
        with state.step(step):
            loss = model(x).sum()
            state.commit_forward()
            loss.backward()
        if telemetry is not None:
            apply = telemetry.before_optimizer_step(opt, loss=loss.detach())
        else:
            apply = all(torch.isfinite(p.grad).all() for p in model.parameters())
        if apply:
            opt.step()
        else:
            skipped.append(step)
        opt.zero_grad()
        if telemetry is not None:
            telemetry.after_optimizer_step(step=step)
    return skipped


def _run_with_telemetry(tmp_path, fallback: bool) -> tuple[dict, f8s.Fp8State]:
    state, model, opt = _fresh(fallback)
    tel = TrainingTelemetry(str(tmp_path), model=model, state=state, log_every=1, saturation=False)
    _train(state, model, opt, range(STEPS), telemetry=tel)
    tel.close()
    rows = read_telemetry(tmp_path / "telemetry.jsonl").rows
    return summarize(rows), state


def test_the_outlier_layer_skips_steps_without_the_fallback_and_not_with_it(tmp_path):
    off, _ = _run_with_telemetry(tmp_path / "off", fallback=False)
    on, state = _run_with_telemetry(tmp_path / "on", fallback=True)
    # without: every step after the scales caught up with the outliers is skipped
    assert off["steps skipped"] == STEPS - OUTLIER_STEP - 1
    # with: the step that shows the fault is skipped, fc1 moves at its end, later steps apply
    assert on["steps skipped"] == 1
    assert dict(state.protocol.fallen_back) == {"fc1": OUTLIER_STEP + 1}
    assert [(e.layer, e.step, e.reason) for e in state.protocol.fallback.events] == [
        ("fc1", OUTLIER_STEP + 1, "nonfinite")
    ]
    # the report names the layer and the step; the run without the fallback names none
    assert on["fallen back to high precision"] == f"fc1 (step {OUTLIER_STEP + 1})"
    assert "fallen back to high precision" not in off


def test_saturation_moves_a_layer_after_patience_events_only():
    cfg = f8s.QuantConfig(fallback=True, fallback_on_nonfinite=False, fallback_patience=2)
    state = f8s.Fp8State(cfg)
    model = state.convert(nn.Sequential(nn.Linear(16, 16)))
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        # from step 2 each input is 100x the last: the delayed scale clamps most of it every event
        x = torch.randn(32, 16, generator=g) * (100.0 ** max(step - 1, 0))
        with state.step(step):
            model(x).sum().backward()
        moved = dict(state.protocol.fallen_back)
        assert moved == ({} if step < 3 else {"0": 3}), step
    assert state.protocol.fallback.events[0].reason == "saturation"


def _state_after_switch():
    state, model, opt = _fresh(True)
    _train(state, model, opt, range(6))
    return state, model, opt


def test_the_moved_layers_travel_in_the_state_dict_and_need_the_fallback_on(tmp_path):
    state, _, _ = _state_after_switch()
    path = tmp_path / "state.pt"
    torch.save(state.state_dict(), path)
    saved = torch.load(path, weights_only=True)
    assert saved["format_version"] == f8s.STATE_FORMAT_VERSION == 3
    other, _, _ = _fresh(True)
    other.load_state_dict(saved)
    assert dict(other.protocol.fallen_back) == {"fc1": OUTLIER_STEP + 1}
    off, _, _ = _fresh(False)
    with pytest.raises(StateLoadError, match=r"moved layers \['fc1'\].*quant.fallback=true"):
        off.load_state_dict(saved)
    broken = dict(saved, fallback={"events": [["fc1", 4, 0, "bored"]], "streaks": {}, "layers": []})
    with pytest.raises(StateLoadError, match="fallback"):
        other.load_state_dict(broken)


def test_a_resume_after_the_switch_continues_bitwise_the_uninterrupted_run():
    state_a, model_a, opt_a = _fresh(True)
    _train(state_a, model_a, opt_a, range(STEPS))
    state_b, model_b, opt_b = _state_after_switch()
    saved = (state_b.state_dict(), model_b.state_dict(), opt_b.state_dict())
    state_c, model_c, opt_c = _fresh(True)
    state_c.load_state_dict(saved[0])
    model_c.load_state_dict(saved[1])
    opt_c.load_state_dict(saved[2])
    assert _train(state_c, model_c, opt_c, range(6, STEPS)) == []
    assert dict(state_c.protocol.fallen_back) == dict(state_a.protocol.fallen_back) == {"fc1": OUTLIER_STEP + 1}
    for (name, a), (_, c) in zip(model_a.state_dict().items(), model_c.state_dict().items(), strict=True):
        assert bitwise_equal(a, c), name
    assert bitwise_equal(state_a.bank.amax_history, state_c.bank.amax_history)


def test_the_fallback_is_off_by_default_and_its_keys_are_checked():
    state, model, opt = _fresh(False)
    assert state.protocol.fallback is None and state.protocol.fallen_back == {}
    with pytest.raises(ConfigError, match=r"fallback_to='fp16' is not allowed: expected one of \['bf16', 'current'\]"):
        f8s.QuantConfig(fallback_to="fp16")
    with pytest.raises(ConfigError, match="fallback_saturation=0 is not allowed"):
        f8s.QuantConfig(fallback_saturation=0)
    with pytest.raises(ConfigError, match="fallback_patience=0 is not allowed"):
        f8s.QuantConfig(fallback_patience=0)


def test_golden_state_v3_loads_with_the_move_its_maker_made():
    """tests/golden/state_v3.pt: written by tests/golden/make_state_v3.py (see its docstring)."""
    saved = torch.load(Path(__file__).parent.parent / "golden" / "state_v3.pt", weights_only=True)
    assert saved["format_version"] == 3
    assert saved["fallback"]["events"] == [["0", 3, 0, "nonfinite"]]
    state = f8s.Fp8State(f8s.QuantConfig(history_len=4, fallback=True))
    state.load_state_dict(saved)
    assert dict(state.protocol.fallen_back) == {"0": 3}
    weight = next(i for i, o in enumerate(state.bank.owners) if o.role == "weight")
    assert state.bank.amax_history[:, weight].max().item() == pytest.approx(1e37, rel=1e-6)
    # a moved layer runs in high precision: the identity weight's 1e37 reaches the output as is
    model = state.convert(nn.Sequential(nn.Linear(4, 4, bias=False)))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].weight[0, 0] = 1e37
    with state.step(4):
        y = model(torch.ones(1, 4))
        y.sum().backward()
    assert y[0, 0].item() == pytest.approx(1e37, rel=1e-6) and torch.isfinite(y).all()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.register_buffer("gain", torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x * self.gain))


def _graphed_run(graphed: bool):
    """The outlier run on two checkpointed blocks, per-block graphs (emulated) or eager."""
    from lightning_fp8state.graphs import GraphedBlocks
    from tests.graph_emulation import EmulatedGraphBackend

    torch.manual_seed(0)
    blocks = nn.ModuleList([_Block(), _Block()])
    state = f8s.Fp8State(f8s.QuantConfig(fallback=True))
    state.convert(blocks)
    runner = GraphedBlocks(blocks, warmup=2, backend=EmulatedGraphBackend()) if graphed else None
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    losses, skipped = [], []
    for step in range(STEPS):
        if step == OUTLIER_STEP:
            with torch.no_grad():
                blocks[0].fc.weight[0, 0] = 1e37
                blocks[0].gain[1] = 1e8
        with state.step(step):
            x = _batches()[step]
            if runner is not None:
                y = runner(x)
            else:
                y = x
                for block in blocks:
                    y = f8s.checkpoint(block, y, engine="torch", use_reentrant=False)
            loss = y.sum()
            state.commit_forward()
            loss.backward()
        losses.append(loss.detach().clone())
        if all(torch.isfinite(p.grad).all() for p in blocks.parameters()):
            opt.step()
        else:
            skipped.append(step)
        opt.zero_grad()
    return state, runner, losses, skipped


def test_per_block_graphs_capture_again_once_when_a_layer_moves():
    """The graphs hold the moved layer's FP8 calls: the pass after the move captures again (once),
    and the graphed run stays bitwise the eager one, the move included."""
    ref_state, _, ref_losses, ref_skipped = _graphed_run(False)
    state, runner, losses, skipped = _graphed_run(True)
    assert ref_state.protocol.fallen_back == state.protocol.fallen_back == {"0.fc": OUTLIER_STEP + 1}
    assert runner.recaptures == 1 and skipped == ref_skipped == [OUTLIER_STEP + 1]
    for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        assert bitwise_equal(a, b), f"step {i}: loss"
