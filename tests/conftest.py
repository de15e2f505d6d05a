"""Shared model builders and run loops for the protocol tests."""

from __future__ import annotations

import copy
import os

import lightning.pytorch  # noqa: F401  (below)
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import lightning_fp8state as f8s

# Lightning gives its logger a StreamHandler on sys.stderr when lightning.pytorch is first
# imported. Imported here, at collection, that is pytest's session stream; first imported inside
# a test that uses capsys (a benchmark script's --help), it would be that test's capture, closed
# when the test ends, and every later Trainer's info lines would print a "Logging error"
# traceback (tests/cli alone failed test_faults' no-traceback checks that way).

# (engine, use_reentrant) for the wrapper; "plain" = torch's checkpoint without the wrapper.
# Under pytest-xdist (``-n 2``: one worker process per core) each worker computes on one thread:
# torch's default (every core) in each would put two threads on each core. OMP_NUM_THREADS too:
# Lightning sets torch's thread count from the cores when it is unset (a Trainer in one test
# changed the count under the next, whose bitwise comparison then compared reductions of two
# thread counts), and the ranks the tests launch inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

ENGINES = [("torch", False), ("torch", True), ("deepspeed", None)]
ENGINE_IDS = ["torch-nonreentrant", "torch-reentrant", "deepspeed"]


class Block(nn.Module):
    """x + fc2(gelu(fc1(x))) * gain: gain makes layers' magnitudes differ widely."""

    def __init__(self, d: int, gain: float = 1.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.gain = gain

    def forward(self, x):
        return x * self.gain + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Stack(nn.Module):
    """Blocks run ascending; each optionally checkpointed, so recompute runs descending."""

    def __init__(self, n: int = 4, d: int = 16, gains=None, ckpt=None) -> None:
        super().__init__()
        gains = gains or [1.0] * n
        self.blocks = nn.ModuleList(Block(d, g) for g in gains)
        # None | ("torch", reentrant) | ("deepspeed", None) | ("plain", reentrant) | ("plain_deepspeed", None)
        self.ckpt = ckpt

    def forward(self, x):
        for block in self.blocks:
            x = self.run_block(block, x)
        return x

    def run_block(self, block, x):
        if self.ckpt is None:
            return block(x)
        engine, reentrant = self.ckpt
        if engine == "plain":
            return torch_checkpoint(block, x, use_reentrant=reentrant)
        if engine == "plain_deepspeed":
            import deepspeed

            return deepspeed.checkpointing.checkpoint(block, x)
        if engine == "deepspeed":
            return f8s.checkpoint(block, x, engine="deepspeed")
        return f8s.checkpoint(block, x, engine="torch", use_reentrant=reentrant)


def make_stack(n=4, d=16, seed=0, gains=None, ckpt=None) -> Stack:
    torch.manual_seed(seed)
    return Stack(n, d, gains, ckpt)


def event_inputs(n_events: int, d: int = 16, batch: int = 8, seed: int = 1, scale_growth: float = 1.5):
    """Fresh random inputs whose magnitude changes every event (so scales must move)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, d, generator=g) * (scale_growth**i) for i in range(n_events)]


def run_events(state, model, xs, *, commit_forward=True, step0=0):
    """One event per input: forward, (commit_forward), backward. Returns outputs and grads."""
    outs, grads = [], []
    for i, x in enumerate(xs):
        x = x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        with state.step(step0 + i):
            y = model(x)
            loss = y.float().pow(2).mean()
            if commit_forward:
                state.commit_forward()
            loss.backward()
        outs.append(y.detach().clone())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()} | {"x": x.grad.clone()})
    return outs, grads


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def clone_model(model):
    return copy.deepcopy(model)


@pytest.fixture
def fresh_state():
    def make(**kw):
        return f8s.Fp8State(f8s.QuantConfig(**kw))

    return make


def skip_reasons(skipped) -> list[tuple[int, str]]:
    """Skipped test reports grouped by reason: ``(count, reason)``, the most frequent first."""
    from collections import Counter

    reasons = Counter()
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    return [(n, reason) for reason, n in reasons.most_common()]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skips as one line per reason with its count (``-rfE`` lists failures and errors only)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.section(f"{len(skipped)} skipped, by reason", sep="-")
    for n, reason in skip_reasons(skipped):
        terminalreporter.line(f"{n:5d}  {reason}")
