"""Recompute leaves module state alone (issue 27): ``lightning_fp8state.checkpoint`` writes back
every buffer its recompute changed (``restore_buffers=True``, the default), so BatchNorm's
running statistics and ``num_batches_tracked`` after N checkpointed steps are bitwise those of
the run without checkpointing, under torch non-reentrant (early stop inside the region's last
Linear, after the BatchNorm), torch reentrant, DeepSpeed and torch SAC. ``restore_buffers=False``
shows the defect (each step counted twice). The modules whose buffers are restored are found
from the region's callable and arguments; others are named with ``restore_buffers=``.

Before issue 27 the recompute's second update lasted: ``num_batches_tracked`` reached 12 after 6
steps and the running statistics drifted.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal

STEPS = 6
D = 16
ENGINES = {
    "torch-nonreentrant": {"engine": "torch", "use_reentrant": False},
    "torch-reentrant": {"engine": "torch", "use_reentrant": True},
    "deepspeed": {"engine": "deepspeed"},
    "sac": {"context_fn": f8s.selective_checkpoint_context()},
}


class NormBlock(nn.Module):
    """x + out(gelu(bn(fc(x)))): the BatchNorm sits before the region's last Linear, so torch's
    early stop ends the recompute after it has updated its statistics a second time."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.bn(self.fc(x))))


class Net(nn.Module):
    """Two NormBlocks, each optionally checkpointed through ``region(block, x)``."""

    def __init__(self, region=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([NormBlock(), NormBlock()])
        self.region = region

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.region is None else self.region(block, x)
        return x


def inputs(steps: int = STEPS, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, D, generator=g) * (1.5**i)).to(device) for i in range(steps)]


def train(region, *, device="cpu", autocast: bool = False, steps: int = STEPS):
    """``steps`` AdamW steps of a converted :class:`Net` (safe FP8), one event each; returns the
    model (its buffers) and every step's gradients."""
    torch.manual_seed(0)
    model = Net(region)
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(model)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for step, x in enumerate(inputs(steps, device)):
        x = x.requires_grad_()
        opt.zero_grad(set_to_none=True)
        with state.step(step):
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
                y = model(x)
            loss = y.float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    assert not state.ledger.violations
    return model, grads


def wrapper(restore_buffers=True, **kw):
    return lambda block, x: f8s.checkpoint(block, x, restore_buffers=restore_buffers, **kw)


def assert_buffers_bitwise(ref: nn.Module, got: nn.Module) -> None:
    bufs = dict(got.named_buffers())
    for name, want in ref.named_buffers():
        assert bitwise_equal(want, bufs[name]), f"{name}: {want.reshape(-1)[:4]} != {bufs[name].reshape(-1)[:4]}"


@pytest.fixture(scope="module")
def plain():
    return train(None)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_batchnorm_statistics_after_n_steps_equal_the_uncheckpointed_run_bitwise(plain, engine):
    ref, ref_grads = plain
    got, grads = train(wrapper(**ENGINES[engine]))
    assert int(got.blocks[0].bn.num_batches_tracked) == STEPS
    assert_buffers_bitwise(ref, got)
    for step, (a, b) in enumerate(zip(ref_grads, grads, strict=True)):  # and training itself is unchanged
        assert all(bitwise_equal(a[n], b[n]) for n in a), step


@pytest.mark.parametrize("engine", ["torch-nonreentrant", "deepspeed"])
def test_restore_buffers_false_lets_the_recompute_count_twice(plain, engine):
    ref, _ = plain
    got, _ = train(wrapper(restore_buffers=False, **ENGINES[engine]))
    assert int(got.blocks[0].bn.num_batches_tracked) == 2 * STEPS
    assert not bitwise_equal(ref.blocks[0].bn.running_mean, got.blocks[0].bn.running_mean)


@pytest.mark.parametrize(
    "how",
    ["bound method", "closure", "partial", "module argument", "explicit module"],
)
def test_the_region_modules_are_found_from_the_callable_and_its_arguments(how):
    def run_block(block, x):
        return block(x)

    regions = {
        "bound method": lambda block, x: f8s.checkpoint(block.forward, x),
        "closure": lambda block, x: f8s.checkpoint(lambda h: block(h), x),
        "partial": lambda block, x: f8s.checkpoint(functools.partial(run_block, block), x),
        "module argument": lambda block, x: f8s.checkpoint(run_block, block, x, use_reentrant=False),
        # reached through a dict, invisible to the search: named explicitly
        "explicit module": lambda block, x: f8s.checkpoint(
            lambda h, blocks={"b": block}: blocks["b"](h), x, restore_buffers=block
        ),
    }
    got, _ = train(regions[how], steps=3)
    ref3, _ = train(None, steps=3)
    assert_buffers_bitwise(ref3, got)


def test_a_module_the_search_cannot_see_is_not_restored():
    """The documented limit: a module reached through another object is not watched (and the
    audit still reports what its recompute changed); ``restore_buffers=module`` fixes it."""
    hidden = lambda block, x: f8s.checkpoint(lambda h, blocks={"b": block}: blocks["b"](h), x)  # noqa: E731
    got, _ = train(hidden, steps=3)
    assert int(got.blocks[0].bn.num_batches_tracked) == 6


class Counting(nn.Module):
    """Buffers changed in place by Python code and replaced by a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("total", torch.zeros(D))

    def forward(self, x):
        self.seen.add_(1)
        self.total = self.total + x.detach().sum(0)  # a new tensor under the buffer's name
        return self.fc(x)


@pytest.mark.parametrize("engine", ["torch-nonreentrant", "torch-reentrant", "deepspeed"])
def test_any_registered_buffer_is_restored_in_place_or_replaced(engine):
    def go(ckpt: bool):
        torch.manual_seed(0)
        model = Counting()
        state = f8s.Fp8State(f8s.QuantConfig())
        state.convert(model)
        total = model.total
        for step, x in enumerate(inputs(3)):
            with state.step(step):
                y = f8s.checkpoint(model, x.requires_grad_(), **ENGINES[engine]) if ckpt else model(x)
                y.float().pow(2).mean().backward()
        return model, total

    ref, _ = go(False)
    got, first_total = go(True)
    assert float(got.seen) == 3.0
    assert bitwise_equal(ref.total, got.total)
    assert got.total is not first_total  # the true forward's own replacement stays


def test_the_audit_reports_only_what_lasts():
    """Under the wrapper the BatchNorm's second update is undone, so the audit does not report
    it; an attribute written in forward (not a buffer) is still reported. Under torch's own
    checkpoint the buffers' change lasts and is reported (tests/unit/test_audit.py)."""

    class Drifting(NormBlock):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return super().forward(x)

    torch.manual_seed(0)
    model = Net(wrapper())
    model.blocks[1] = Drifting()
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(model)
    with f8s.RecomputeAuditor(state, model=model) as auditor:
        for step, x in enumerate(inputs(2)):
            with state.step(step):
                model(x.requires_grad_()).pow(2).mean().backward()
    changes = {(c.module, c.name, c.kind) for c in auditor.report().state_changes}
    assert changes == {("blocks.1", "calls", "attribute")}


def test_restore_buffers_takes_a_bool_or_modules():
    block = NormBlock()
    x = torch.randn(4, D)
    for bad in ("yes", 1, [block, "bn"], None):
        with pytest.raises(
            f8s.ConfigError, match=r"restore_buffers=.* is not allowed: expected True, False, an nn.Module"
        ):
            f8s.checkpoint(block, x, restore_buffers=bad)
    with torch.no_grad():  # the allowed forms
        for ok in (True, False, block, [block.bn], (block,)):
            f8s.checkpoint(block, x, restore_buffers=ok, use_reentrant=False)
