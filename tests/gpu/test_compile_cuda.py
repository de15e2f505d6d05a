"""torch.compile on the GPU: each block one Inductor graph with Fp8Linear as its opaque op
(``fp8state::fp8_linear``, _scaled_mm and the CUDA kernels inside), bitwise the eager run,
no host sync inside a step, and captured whole by GraphedStep (compile+graphs, the benchmark's
fastest mode) with the replay bitwise the compiled eager run."""

from __future__ import annotations

import torch

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT
from tests.conftest import bitwise_equal

# the same model, data and step body as the eager GraphedStep tests
from tests.gpu.test_graphs import CFG, batches, make_body, pytestmark  # noqa: F401  (pytestmark: the GPU marks)

STEPS = 5


def build(compiled: bool, graphs: bool = False):
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    state = f8s.Fp8State(f8s.QuantConfig(mode="safe", strict=True))
    state.convert(model)
    if compiled:
        torch._dynamo.reset()
        for block in model.blocks:
            block.compile(fullgraph=True)  # Inductor; a graph break raises
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=graphs)
    return model, state, opt


def run(data, compiled: bool, sync_check_from: int | None = None):
    model, state, opt = build(compiled)
    body = make_body(model, state)
    losses = []
    for n, (x, y) in enumerate(data):
        if sync_check_from is not None and n >= sync_check_from:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with state.step(n, 0):
                losses.append(body(x, y))
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return model, state, torch.stack(losses)


def assert_same(run_a, run_b):
    (ma, sa, la), (mb, sb, lb) = run_a, run_b
    assert bitwise_equal(la, lb), (la, lb)
    for (name, p), q in zip(ma.named_parameters(), mb.parameters(), strict=True):
        assert bitwise_equal(p, q), name
    assert bitwise_equal(sa.bank.scale, sb.bank.scale)
    assert bitwise_equal(sa.bank.amax_history, sb.bank.amax_history)


def test_compiled_training_is_bitwise_the_eager_run_and_never_syncs():
    data = batches(STEPS)
    eager = run(data, compiled=False)
    compiled = run(data, compiled=True, sync_check_from=2)  # steps 0-1 compile and calibrate
    assert_same(eager, compiled)
    assert not compiled[1].ledger.violations


def test_compiled_blocks_captured_by_graphed_step_replay_the_compiled_run():
    data = batches(STEPS)
    reference = run(data, compiled=True)
    model, state, opt = build(compiled=True, graphs=True)
    graphed = f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt, warmup=2)
    losses = torch.stack([graphed(n, x, y).clone() for n, (x, y) in enumerate(data)])
    assert graphed.replays == STEPS - 2
    assert_same(reference, (model, state, losses))
