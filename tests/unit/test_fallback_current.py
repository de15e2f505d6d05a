"""QuantConfig.fallback_to="current": a moved layer runs FP8 scaled from each call's own amax.

The outlier: from step 3 on, ``fc1``'s weight holds one element of 1e37; at step 3 only, its
input carries one feature scaled by 1e8. Delayed scaling keeps that input amax in its history:
at step 4 the input's descale (1e8/448) times the weight's (1e37/448) overflows float32 in the
FP8 GEMM's epilogue and fc1's output is inf/NaN, though step 4's input is an ordinary one. That
goes on while the history holds the 1e8 (every later step of the run). A per-call scale follows
the input back down at once: after the move fc1's FP8 output is finite again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import StateLoadError
from lightning_fp8state.telemetry import TrainingTelemetry
from lightning_fp8state.telemetry.report import summarize
from lightning_fp8state.telemetry.sinks import read_telemetry
from tests.conftest import bitwise_equal

STEPS, OUTLIER_STEP, MOVE_STEP = 8, 3, 4
E4M3_MAX = 448.0


class _Net(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)
        self.register_buffer("gain", torch.ones(32))
        self.checkpointed = checkpointed

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc1(x * self.gain))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = f8s.checkpoint(self._first, x, engine="torch", use_reentrant=False) if self.checkpointed else self._first(x)
        return torch.tanh(self.fc2(h))


def _outliers(model: _Net, step: int) -> None:
    with torch.no_grad():
        if step == OUTLIER_STEP:
            model.fc1.weight[0, 0] = 1e37
        model.gain[1] = 1e8 if step == OUTLIER_STEP else 1.0


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(64, 32, generator=g) for _ in range(STEPS)]


def _fresh(fallback: bool = True, to: str = "current", checkpointed: bool = False):
    torch.manual_seed(0)
    model = _Net(checkpointed)
    state = f8s.Fp8State(f8s.QuantConfig(fallback=fallback, fallback_to=to))
    state.convert(model)
    return state, model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _train(state, model, opt, steps, *, telemetry=None, seen=None) -> list[int]:
    """Train ``steps``; returns the steps skipped (gradients not all finite). ``seen``: a list
    that gets ``(step, fc1's input, weight, bias, output)`` of every true forward of fc1."""
    skipped = []
    hook = None
    if seen is not None:

        def note(module, args, out):
            if torch._C._current_graph_task_id() == -1:  # a true forward, not a recompute in backward
                operands = (args[0], module.weight, module.bias)
                seen.append((state.clock.event[0], *(t.detach().clone() for t in operands), out.detach()))

        hook = model.fc1.register_forward_hook(note)
    for step in steps:
        _outliers(model, step)
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
    if hook is not None:
        hook.remove()
    return skipped


def _current_scaled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The per-tensor current-scaling linear written out from its definition: each operand's
    scale ``448 / amax`` of its own values, codes ``round_to_E4M3(clamp(v * scale))``, the float32
    product of the codes times both descales, plus the bias."""

    def encode(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.tensor(E4M3_MAX, dtype=torch.float32) / v.abs().max().to(torch.float32)
        codes = (v.to(torch.float32) * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return codes.to(torch.float32), 1.0 / scale

    xq, dx = encode(x.reshape(-1, x.shape[-1]))
    wq, dw = encode(weight)
    return ((xq @ wq.t()) * (dx * dw) + bias.to(torch.float32)).reshape(*x.shape[:-1], -1)


def test_current_target_skips_fewer_steps_and_the_layer_then_quantizes_per_call():
    off = _fresh(fallback=False)
    assert _train(*off, range(STEPS)) == list(range(MOVE_STEP, STEPS))  # every step after the outlier
    state, model, opt = _fresh()
    seen: list = []
    assert _train(state, model, opt, range(STEPS), seen=seen) == [MOVE_STEP]
    protocol = state.protocol
    assert dict(protocol.fallen_back) == {"fc1": MOVE_STEP}
    assert [(e.layer, e.step, e.reason, e.target) for e in protocol.fallback.events] == [
        ("fc1", MOVE_STEP, "nonfinite", "current")
    ]
    assert protocol.recipe_of("fc1").name == "fp8_current" and protocol.recipe_of("fc2").name == "fp8_delayed"
    (_, x, weight, bias, y), *_ = [call for call in seen if call[0] == OUTLIER_STEP]
    assert not bitwise_equal(y, _current_scaled_linear(x, weight, bias))  # delayed scaling before the move
    after = [call for call in seen if call[0] > MOVE_STEP]
    assert [call[0] for call in after] == list(range(MOVE_STEP + 1, STEPS))
    for step, x, weight, bias, y in after:
        # bitwise the per-call current-scaling product of this call's own operands
        assert bitwise_equal(y, _current_scaled_linear(x, weight, bias)), step
        assert torch.isfinite(y).all(), step
    # fc1's roles are stateless owners now: each observed and committed once per event in the ledger
    fc1 = [o for o in protocol.dynamic_snapshots() if o.layer == "fc1"]
    assert sorted(o.role for o in fc1) == ["grad_output", "input", "weight"]
    for owner in fc1:
        assert state.ledger.commits(owner, (STEPS - 1, 0)) == 1
        assert protocol.dynamic_snapshots()[owner].step == STEPS - 1


def test_the_moved_layers_delayed_state_stops_and_the_others_go_on():
    state, model, opt = _fresh()
    _train(state, model, opt, range(MOVE_STEP + 2))
    bank = state.bank
    frozen = {o: i for i, o in enumerate(bank.owners) if o.layer == "fc1"}
    before = bank.amax_history.clone()
    _train(state, model, opt, range(MOVE_STEP + 2, STEPS))
    for owner, i in frozen.items():
        assert bitwise_equal(bank.amax_history[:, i], before[:, i]), owner
    others = [i for i, o in enumerate(bank.owners) if o.layer == "fc2"]
    assert not bitwise_equal(bank.amax_history[:, others], before[:, others])


def test_a_checkpointed_moved_layer_recomputes_read_only_and_bitwise():
    """Under activation checkpointing the moved layer's recompute re-derives its per-call scale
    from the same input: the run ends bitwise the one without checkpointing (strict ledger: a
    recompute that recorded would raise)."""
    plain = _fresh()
    ckpt = _fresh(checkpointed=True)
    assert _train(*plain, range(STEPS)) == _train(*ckpt, range(STEPS)) == [MOVE_STEP]
    for (name, a), (_, b) in zip(plain[1].state_dict().items(), ckpt[1].state_dict().items(), strict=True):
        assert bitwise_equal(a, b), name
    owner = next(o for o in ckpt[0].protocol.dynamic_snapshots() if o.layer == "fc1" and o.role == "input")
    assert ckpt[0].ledger.commits(owner, (STEPS - 1, 0)) == 1


@pytest.mark.parametrize("resume_with", ["current", "bf16"])
def test_a_resume_after_the_move_continues_bitwise_and_keeps_the_saved_target(tmp_path, resume_with):
    """The target travels with the move: a resume whose config says fallback_to=bf16 still runs
    the layer the saved run moved to current scaling as it was moved."""
    state_a, model_a, opt_a = _fresh()
    _train(state_a, model_a, opt_a, range(STEPS))
    state_b, model_b, opt_b = _fresh()
    _train(state_b, model_b, opt_b, range(MOVE_STEP + 2))
    path = tmp_path / "state.pt"
    torch.save(state_b.state_dict(), path)
    saved = torch.load(path, weights_only=True)
    assert saved["fallback"]["events"] == [["fc1", MOVE_STEP, 0, "nonfinite", "current"]]
    state_c, model_c, opt_c = _fresh(to=resume_with)
    state_c.load_state_dict(saved)
    model_c.load_state_dict(model_b.state_dict())
    opt_c.load_state_dict(opt_b.state_dict())
    assert state_c.protocol.recipe_of("fc1").name == "fp8_current"
    assert _train(state_c, model_c, opt_c, range(MOVE_STEP + 2, STEPS)) == []
    for (name, a), (_, c) in zip(model_a.state_dict().items(), model_c.state_dict().items(), strict=True):
        assert bitwise_equal(a, c), name
    assert bitwise_equal(state_a.bank.amax_history, state_c.bank.amax_history)


def test_a_saved_move_with_an_unknown_target_is_refused():
    state, _, _ = _fresh()
    sd = state.state_dict()
    broken = dict(sd, fallback={"events": [["fc1", 4, 0, "nonfinite", "fp16"]], "streaks": {}, "layers": ["fc1"]})
    with pytest.raises(StateLoadError, match="fallback.*targets"):
        state.load_state_dict(broken)


def test_the_report_and_the_jsonl_name_the_target(tmp_path):
    state, model, opt = _fresh()
    tel = TrainingTelemetry(str(tmp_path), model=model, state=state, log_every=1, saturation=False)
    _train(state, model, opt, range(STEPS), telemetry=tel)
    tel.close()
    rows = read_telemetry(tmp_path / "telemetry.jsonl").rows
    assert any(r.get("fp8state/fallback_current/fc1") == MOVE_STEP for r in rows)
    summary = summarize(rows)
    assert summary["fallen back to current scaling"] == f"fc1 (step {MOVE_STEP})"
    assert "fallen back to high precision" not in summary
    assert summary["steps skipped"] == 1


def test_a_module_without_a_route_is_watched_but_not_moved():
    """Only Fp8Linear runs a moved layer's route: a converted Conv1D (GPT-2's) whose FP8 output
    goes non-finite is not listed as moved (it would go on in FP8), and its calls go on."""
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415  (transformers: this test only)

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(32, 32))
    state = f8s.Fp8State(f8s.QuantConfig(fallback=True, fallback_to="current"))
    state.convert(model)
    gain = torch.ones(32)
    for step in range(6):
        with torch.no_grad():
            if step == OUTLIER_STEP:
                model[0].weight[0, 0] = 1e37  # Conv1D's weight is [in, out]
            gain[0] = 1e8 if step == OUTLIER_STEP else 1.0
        with state.step(step):
            y = model(_batches()[step] * gain)
            y.sum().backward()
        model.zero_grad()
    assert not torch.isfinite(y).all()  # the fault went on: the layer kept its delayed scaling
    assert state.protocol.fallen_back == {} and state.protocol.layer_recipes == {}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.register_buffer("gain", torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x * self.gain))


def _blocks_run(graphed: bool):
    """The outlier on the first of two checkpointed blocks, per-block graphs (emulated) or eager."""
    from lightning_fp8state.graphs import GraphedBlocks  # noqa: PLC0415
    from tests.graph_emulation import EmulatedGraphBackend  # noqa: PLC0415

    torch.manual_seed(0)
    blocks = nn.ModuleList([_Block(), _Block()])
    state = f8s.Fp8State(f8s.QuantConfig(fallback=True, fallback_to="current"))
    state.convert(blocks)
    runner = GraphedBlocks(blocks, warmup=2, backend=EmulatedGraphBackend()) if graphed else None
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    losses, skipped = [], []
    for step in range(STEPS):
        with torch.no_grad():
            if step == OUTLIER_STEP:
                blocks[0].fc.weight[0, 0] = 1e37
            blocks[0].gain[1] = 1e8 if step == OUTLIER_STEP else 1.0
        with state.step(step):
            y = _batches()[step]
            if runner is not None:
                y = runner(y)
            else:
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


def test_per_block_graphs_capture_the_current_route_once_and_match_eager():
    ref_state, _, ref_losses, ref_skipped = _blocks_run(False)
    state, runner, losses, skipped = _blocks_run(True)
    assert ref_state.protocol.fallen_back == state.protocol.fallen_back == {"0.fc": MOVE_STEP}
    assert state.protocol.recipe_of("0.fc").name == "fp8_current"
    assert runner.recaptures == 1 and skipped == ref_skipped == [MOVE_STEP]
    for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        assert bitwise_equal(a, b), f"step {i}: loss"


def test_a_move_saved_before_targets_existed_loads_as_bf16():
    """tests/golden/state_v3.pt holds a four-field move (no target): it went to bf16, and stays
    there under a config that says current."""
    saved = torch.load(Path(__file__).parent.parent / "golden" / "state_v3.pt", weights_only=True)
    assert saved["fallback"]["events"] == [["0", 3, 0, "nonfinite"]]
    state = f8s.Fp8State(f8s.QuantConfig(history_len=4, fallback=True, fallback_to="current"))
    state.load_state_dict(saved)
    assert state.protocol.recipe_of("0").name == "bf16"
    assert state.state_dict()["fallback"]["events"] == [["0", 3, 0, "nonfinite", "bf16"]]
