"""QuantConfig.fallback under the whole-step CUDA graph (GraphedStep), on the GPU.

The capture records the event's end, whose fallback decision reads flags on the host: it is
deferred during the capture and taken after each replay, from the flags the replay updated in
place. A move after the capture makes the graph stale: the next call captures again, once. The
graphed run is bitwise the eager one, the move included.

The outlier (as in tests/unit/test_fallback_current.py): fc1's weight holds 1e37 from step 3 on,
its input one feature at 1e8 at step 3 only; delayed scaling's descales then overflow float32 in
fc1's GEMM at step 4 (the emulated GEMM: its float32 epilogue multiplies the two descales first,
whatever cuBLASLt does with them), fc1 moves at step 4's end. With warmup=2 the capture is step 2,
steps 3 and 4 are replays, so the move is decided from a replay's flags.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS, OUTLIER_STEP, MOVE_STEP, WARMUP = 8, 3, 4, 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)
        self.register_buffer("gain", torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x * self.gain))))


def _run(graphed: bool, target: str):
    torch.manual_seed(0)
    model = _Net().cuda()
    state = f8s.Fp8State(f8s.QuantConfig(fallback=True, fallback_to=target, gemm="emulated"))
    state.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(64, 32, device="cuda", generator=g) for _ in range(STEPS)]

    def body(x):
        loss = model(x).sum()
        state.commit_forward()
        loss.backward()
        return loss.detach()

    runner = f8s.GraphedStep(state, body, xs[0], warmup=WARMUP) if graphed else None
    grads: list = []  # (param, its gradient in the graph), as GraphedTrainingStep keeps them
    losses, skipped, moved_after = [], [], []
    for step in range(STEPS):
        with torch.no_grad():
            if step == OUTLIER_STEP:
                model.fc1.weight[0, 0] = 1e37
            model.gain[1] = 1e8 if step == OUTLIER_STEP else 1.0
        if runner is None:
            opt.zero_grad(set_to_none=True)
            with state.step(step):
                loss = body(xs[step])
        else:
            if runner.graph is not None:
                runner.drop_if_stale()
            if runner.graph is None:  # warm-up or (re)capture: the gradients start from None
                opt.zero_grad(set_to_none=True)
                loss = runner(step, xs[step])
                if runner.graph is not None:
                    grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
            else:
                for p, grad in grads:
                    p.grad = grad
                loss = runner(step, xs[step])
        losses.append(loss.clone())
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
        else:
            skipped.append(step)
        moved_after.append(dict(state.protocol.fallen_back))
    torch.cuda.synchronize()
    return model, state, runner, losses, skipped, moved_after


@pytest.mark.parametrize("target", ["bf16", "current"])
def test_a_move_decided_from_a_replay_captures_again_once_and_matches_eager(target):
    if not hasattr(f8s.GraphedStep, "drop_if_stale"):
        pytest.fail("GraphedStep.drop_if_stale is missing: the fallback's recapture is not built in")
    ref_model, ref_state, _, ref_losses, ref_skipped, ref_moved = _run(False, target)
    model, state, runner, losses, skipped, moved = _run(True, target)
    assert ref_skipped == skipped == [MOVE_STEP]
    # the move happens at step 4's end (a replay's flags), not later, in both runs
    assert moved == ref_moved and [bool(m) for m in moved] == [s >= MOVE_STEP for s in range(STEPS)]
    assert dict(state.protocol.fallen_back) == {"fc1": MOVE_STEP}
    assert state.protocol.fallback.events[0].target == target
    assert runner.recaptures == 1 and runner.eager_calls == WARMUP
    assert runner.replays == STEPS - WARMUP  # every capture's own event counts as a replay
    for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        assert bitwise_equal(a, b), f"step {step}: loss"
    for (name, a), (_, b) in zip(ref_model.state_dict().items(), model.state_dict().items(), strict=True):
        assert bitwise_equal(a, b), name
    assert bitwise_equal(ref_state.bank.amax_history, state.bank.amax_history)
    assert state.ledger.ok


def test_without_a_move_the_graph_is_not_captured_again():
    """The same run with the outlier's input spike left out: nothing moves, one capture only."""
    torch.manual_seed(0)
    model = _Net().cuda()
    state = f8s.Fp8State(f8s.QuantConfig(fallback=True, gemm="emulated"))
    state.convert(model)
    x = torch.randn(64, 32, device="cuda")

    def body(x):
        loss = model(x).sum()
        state.commit_forward()
        loss.backward()
        return loss.detach()

    runner = f8s.GraphedStep(state, body, x, warmup=WARMUP)
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        runner(step, x)
    assert runner.recaptures == 0 and state.protocol.fallen_back == {}
    assert runner.replays == STEPS - WARMUP
