"""GraphedBlocks with side inputs (rotary-like cos/sin, a mask, a None and a bool keyword) on
the CPU, its graphs emulated: bitwise the eager checkpointed run through the whole-stack call and
through call_block, one commit per owner per event, and each refusal naming its argument."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.graphs import GraphedBlocks
from tests.conftest import bitwise_equal
from tests.graph_emulation import EmulatedGraphBackend

D = 16
B = 8
N_EVENTS = 6
WARMUP = 2


class SideBlock(nn.Module):
    """A residual MLP on a rotary-like mix of its input, masked; returns (hidden, None)."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.gain = gain

    def forward(self, x, cos, sin, mask=None, extra=None, causal=True):
        assert extra is None
        h = x * cos + torch.roll(x, 1, dims=-1) * sin
        if causal:
            h = h.masked_fill(mask, 0.0)
        return x * self.gain + self.fc2(torch.nn.functional.gelu(self.fc1(h))), None


class SideNet(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(SideBlock(1.0 + i) for i in range(n_blocks))
        self.head = nn.Linear(D, 4)
        self.runner: GraphedBlocks | None = None
        self.per_block = False

    def forward(self, x, cos, sin, mask, causal=True):
        h = self.inp(x)
        kw = {"mask": mask, "extra": None, "causal": causal}
        if self.runner is not None and not self.per_block:
            h = self.runner(h, cos, sin, **kw)
        elif self.runner is not None:
            for i in range(len(self.blocks)):
                h, none = self.runner.call_block(i, h, cos, sin, **kw)
                assert none is None
        else:
            for block in self.blocks:
                h = f8s.checkpoint(functools.partial(block, **kw), h, cos, sin, engine="torch", use_reentrant=False)[0]
        return self.head(h)


MASK = torch.rand(B, D, generator=torch.Generator().manual_seed(9)) < 0.2


def side(i: int):
    """Event ``i``'s inputs: cos/sin new tensors each event (other values), the mask one tensor."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(B, D, generator=g) * (1.5**i)
    angle = torch.linspace(0, 3, D) * (1 + 0.1 * i)
    return x, angle.cos().expand(B, D).contiguous(), angle.sin().expand(B, D).contiguous(), MASK


def train(graphed: bool, per_block: bool = False, n=N_EVENTS):
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(SideNet())
    backend = EmulatedGraphBackend()
    if graphed:
        model.runner = GraphedBlocks(model.blocks, warmup=WARMUP, backend=backend)
        model.per_block = per_block
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs, grads = [], []
    for i in range(n):
        with state.step(i):
            y = model(*side(i))
            loss = y.float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        outs.append(y.detach().clone())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return state, model, outs, grads, backend


@pytest.mark.parametrize("per_block", [False, True], ids=["whole-stack", "call_block"])
def test_blocks_with_side_inputs_replay_bitwise_the_eager_checkpointed_run(per_block):
    ref_state, ref_model, ref_outs, ref_grads, _ = train(False)
    state, model, outs, grads, backend = train(True, per_block=per_block)
    runner = model.runner
    assert runner.eager_calls == WARMUP and runner.replays == N_EVENTS - WARMUP
    assert len(backend.graphs) == 2 * 3 and all(g.replays == N_EVENTS - WARMUP for g in backend.graphs)
    for i, (a, b) in enumerate(zip(ref_outs, outs, strict=True)):
        assert bitwise_equal(a, b), f"event {i}: output differs"
    for i, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
        for name in ga:
            assert bitwise_equal(ga[name], gb[name]), f"step {i}: grad of {name} differs"
    assert bitwise_equal(ref_state.bank.scales, state.bank.scales)
    assert ref_state.ledger.events() == state.ledger.events()
    for event in state.ledger.events():
        ref, got = ref_state.ledger.event(event), state.ledger.event(event)
        assert set(ref) == set(got), event
        for owner, rec in got.items():
            r = ref[owner]
            assert (rec.observations, rec.commits, rec.recompute_reads, rec.recompute_records) == (
                r.observations,
                r.commits,
                r.recompute_reads,
                r.recompute_records,
            ), (event, owner)
            assert rec.commits == 1 and rec.recompute_records == 0
    assert state.ledger.ok and not state.ledger.violations
    # cos and sin: one buffer each, shared by the three blocks; the mask: one, never copied again
    statics = {id(s) for g in runner.graphs for s in g.sides}
    assert len(statics) == 3


@pytest.mark.parametrize("per_block", [False, True], ids=["whole-stack", "call_block"])
def test_side_input_refusals_name_the_argument(per_block):
    state, model, _, _, _ = train(True, per_block=per_block)
    x, cos, sin, mask = side(0)
    with state.step(100), pytest.raises(f8s.ConfigError, match=r"dynamic shapes are not captured: argument 'mask'"):
        model(x, cos, sin, mask[:4])
    with state.step(101), pytest.raises(f8s.ConfigError, match=r"argument 'mask' .*changed from \(8, 16\)"):
        model(x, cos, sin, torch.zeros(B, 2 * D, dtype=torch.bool))
    with state.step(102), pytest.raises(f8s.ConfigError, match="argument 'cos' requires grad"):
        model(x, cos.requires_grad_(True), sin, mask)
    with state.step(103), pytest.raises(f8s.ConfigError, match="argument 'causal' .*changed from True to False"):
        model(x, cos.detach(), sin, mask, causal=False)
    # after the refusals the graphs still replay
    with state.step(104):
        y = model(x, cos.detach(), sin, mask)
        state.commit_forward()
        y.sum().backward()
    assert model.runner.replays == N_EVENTS - WARMUP + 1 and torch.isfinite(y).all()
    assert state.ledger.ok


def test_a_non_plain_side_input_and_out_of_order_blocks_are_refused():
    state = f8s.Fp8State(f8s.QuantConfig())
    blocks = nn.ModuleList([SideBlock(1.0), SideBlock(2.0)])
    state.convert(blocks)
    runner = GraphedBlocks(blocks, warmup=1, backend=EmulatedGraphBackend())
    x, cos, sin, mask = side(0)
    with state.step(0), pytest.raises(f8s.ConfigError, match="argument 'past_key_values' is a object.*use_cache"):
        runner(x, cos, sin, mask=mask, past_key_values=object())
    with state.step(1), pytest.raises(f8s.StateTransitionError, match="block 1 was called, block 0 was expected"):
        runner.call_block(1, x, cos, sin, mask=mask)
