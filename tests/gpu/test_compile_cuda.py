"""torch.compile on the GPU: each block one Inductor graph with Fp8Linear as its opaque op
(``fp8state::fp8_linear``, _scaled_mm and the CUDA kernels inside), bitwise the eager run,
no host sync inside a step, and captured whole by GraphedStep (compile+graphs, the benchmark's
fastest mode) with the replay bitwise the compiled eager run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT, GPTConfig
from tests.conftest import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=3, n_heads=4, checkpoint=True)
STEPS = 5


def batches(n, seed=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), device="cuda", generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


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


def make_body(model, state):
    def body(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            state.commit_forward()
            loss.backward()
        return loss.detach()

    return body


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
