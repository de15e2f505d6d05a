"""Compiled models: Fp8Linear is one opaque op in the graph, and every rule still holds.

Under ``torch.compile`` an ``Fp8Linear`` call is ``fp8state::fp8_linear`` (its backward
``fp8state::fp8_linear_backward``): the protocol runs inside the op at run time, so a block
compiles as one graph (``fullgraph=True`` raises on any break). What the compiled model computes
must be bitwise what the eager model computes, forward and recompute must stay bit-identical in
safe mode, the naive defect must still show, and the rules that depend on grad mode or on the
event must still refuse what they refuse eagerly. The FP4 attention quantizer is still a graph
break (``torch.compiler.disable``); the first test runs it too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import StateTransitionError
from lightning_fp8state.models import GPT, GPTConfig
from lightning_fp8state.nn import linear_after
from tests.conftest import bitwise_equal


def audit_compiled(mode: str, steps: int = 2, fp4_attention: bool = True):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = GPT(GPTConfig(d_model=32, n_heads=2, n_layers=2, seq_len=32, fp4_attention=fp4_attention))
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    state.convert(model)
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=not fp4_attention)
    x = torch.randint(0, 64, (2, 32))
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(steps):
            with state.step(step):
                loss = model(x).float().pow(2).mean()
                state.commit_forward()
                loss.backward()
    return auditor.report(), state


@pytest.mark.parametrize("fp4_attention", [True, False], ids=["fp4-attention", "fp8-linears-only"])
@pytest.mark.parametrize("mode", ["safe", "naive"])
def test_compiled_blocks_keep_the_recompute_contract(mode, fp4_attention):
    report, state = audit_compiled(mode, fp4_attention=fp4_attention)
    assert report.recomputed > 0  # the checkpointed calls were recomputed and compared
    if mode == "safe":
        assert report.ok and not report.mismatches
        assert not state.ledger.violations
    else:
        assert report.mismatches, "the naive defect must still show through compiled blocks"


class Mixed(nn.Module):
    """Each way an Fp8Linear is called: LayerNorm prologue (affine and not), GELU prologue, plain,
    with and without bias."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.ln_plain = nn.LayerNorm(d, elementwise_affine=False)
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d, bias=False)
        self.c = nn.Linear(d, d)

    def forward(self, x):
        h = linear_after(self.b, linear_after(self.a, x, norm=self.ln), activation="gelu")
        return x + self.c(h) + linear_after(self.c, h, norm=self.ln_plain)


def _train(model, state, data, compiled: str | None, reentrant: bool = False, autocast: bool = False):
    """Steps of ``model`` (each block checkpointed); returns losses, grads per step and the bank."""
    blocks = model.blocks if hasattr(model, "blocks") else [model]
    if compiled is not None:
        torch._dynamo.reset()
        for block in blocks:
            block.compile(backend=compiled, fullgraph=True)
    losses, grads = [], []
    for step, (x, y) in enumerate(data):
        # (autocast: forward and backward inside the region, which the backward then runs under)
        with state.step(step), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if isinstance(model, GPT):
                loss = model.loss(x, y)
            else:
                x = x.detach().requires_grad_(reentrant)  # a reentrant checkpoint needs an input with grad
                loss = F.mse_loss(f8s.checkpoint(model, x, use_reentrant=reentrant), y)
            state.commit_forward()
            loss.backward()
        losses.append(loss.detach())
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.05 * p.grad
                    p.grad = None
    return losses, grads, state.bank.scale.clone()


def _gpt(reentrant: bool, fuse: bool, exclude: tuple[str, ...] = (), recipe: str = "fp8_delayed", backward=None):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=4, use_reentrant=reentrant))
    backward = backward or "auto"  # the recipe's own formats
    state = f8s.Fp8State(
        f8s.QuantConfig(
            mode="safe", strict=True, fuse_prologues=fuse, exclude=exclude, recipe=recipe, backward_format=backward
        )
    )
    state.convert(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (4, 32), generator=g), torch.randint(0, 64, (4, 32), generator=g)) for _ in range(3)]
    return model, state, data


def _mixed():
    torch.manual_seed(0)
    model = Mixed()
    state = f8s.Fp8State(f8s.QuantConfig(mode="safe", strict=True))
    state.convert(model)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 8, 32, generator=g) * (1 + i), torch.randn(4, 8, 32, generator=g)) for i in range(3)]
    return model, state, data


def _assert_same_run(eager, compiled):
    (le, ge, se), (lc, gc, sc) = eager, compiled
    for step, (a, b) in enumerate(zip(le, lc, strict=True)):
        assert bitwise_equal(a, b), f"loss of step {step}"
    for step, (ga, gb) in enumerate(zip(ge, gc, strict=True)):
        for i, (a, b) in enumerate(zip(ga, gb, strict=True)):
            assert (a is None) == (b is None), f"step {step}, parameter {i}: a gradient in one run only"
            assert a is None or bitwise_equal(a, b), f"step {step}, parameter {i}"
    assert bitwise_equal(se, sc), "the scales the runs advanced to"


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-prologues", "unfused"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_compiled_gpt_is_one_graph_per_block_and_bitwise_the_eager_run(reentrant, fuse):
    eager = _train(*_gpt(reentrant, fuse), compiled=None)
    model, state, data = _gpt(reentrant, fuse)
    compiled = _train(model, state, data, compiled="aot_eager")  # fullgraph: a graph break raises
    _assert_same_run(eager, compiled)
    assert not state.ledger.violations


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused-prologues", "unfused"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_a_stateless_recipe_compiles_to_one_graph_per_block_bitwise_the_eager_run(reentrant, fuse, recipe, monkeypatch):
    """The stateless recipes run as the compiled op too (no graph break: fullgraph), each call's
    scales derived inside it, bitwise the eager run under aot_eager. fp8_rowwise saves its
    high-precision input and weight (``Recipe.saves_inputs``): the Function saves the op's inputs,
    the op returns a key. (They fuse no prologue: the LayerNorm / GELU before a linear is torch's
    op in the graph, which Inductor generates kernels of its own for, with other bits than
    eager's, as for any compiled model.)"""
    from lightning_fp8state.nn import linear_call

    eager = _train(*_gpt(reentrant, fuse, recipe=recipe), compiled=None)
    model, state, data = _gpt(reentrant, fuse, recipe=recipe)
    prologues = []  # the op runs no prologue: as eagerly, torch's LayerNorm / GELU run before it
    real = linear_call.Prologue
    monkeypatch.setattr(linear_call, "Prologue", lambda *a: prologues.append(a) or real(*a))
    compiled = _train(model, state, data, compiled="aot_eager")
    _assert_same_run(eager, compiled)
    assert not state.ledger.violations
    assert prologues == []


@pytest.mark.parametrize(
    "recipe, backward",
    [("fp8_delayed", "e5m2"), ("fp8_current", "e5m2"), ("fp8_rowwise", "e4m3"), ("fp8_rowwise", "e5m2")],
)
def test_compiled_under_autocast_with_the_backward_inside_it_is_bitwise_the_eager_run(recipe, backward):
    """Forward and backward inside a CPU autocast region (as tests/gpu/test_compile_cuda.py's
    step does under CUDA autocast): the compiled op's backward and the eager Function's both run
    their GEMMs outside autocast. The eager one did not, which on the H200 made the compiled
    fp8_rowwise run with E5M2 gradients (float32-emulated GEMMs) leave the eager run's bits."""
    eager = _train(*_gpt(False, False, recipe=recipe, backward=backward), compiled=None, autocast=True)
    model, state, data = _gpt(False, False, recipe=recipe, backward=backward)
    compiled = _train(model, state, data, compiled="aot_eager", autocast=True)  # fullgraph
    _assert_same_run(eager, compiled)
    assert not state.ledger.violations


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_every_call_form_compiles_to_the_eager_result(reentrant):
    """Prologues with and without affine, no bias, a layer called at two sites; checkpointed."""
    eager = _train(*_mixed(), compiled=None, reentrant=reentrant)
    model, state, data = _mixed()
    compiled = _train(model, state, data, compiled="aot_eager", reentrant=reentrant)
    _assert_same_run(eager, compiled)


def test_inductor_compiles_the_block_to_the_eager_result():
    eager = _train(*_gpt(False, True), compiled=None)
    compiled = _train(*_gpt(False, True), compiled="inductor")
    _assert_same_run(eager, compiled)


def test_a_compiled_training_forward_outside_an_event_is_refused():
    """Inside a compiled forward autograd runs with gradients off; the op is told what held at
    trace time, so an eval-looking call cannot slip past the event rule."""
    model, _, data = _gpt(False, True, exclude=("head",))  # the eager head would refuse first
    model.cfg.checkpoint = False
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(StateTransitionError, match="outside a logical event"):
        model(data[0][0])
    with torch.no_grad():  # evaluation: allowed, and the same as eager evaluation
        out = model(data[0][0])
    model_e, _, _ = _gpt(False, True, exclude=("head",))
    with torch.no_grad():
        assert bitwise_equal(out, model_e(data[0][0]))


def test_a_compiled_backward_after_its_event_ended_is_refused():
    model, state, data = _gpt(False, True, exclude=("head",))  # the eager head would refuse first
    model.cfg.checkpoint = False  # the backward reaches the linears' op, not a recompute first
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    with state.step(0):
        loss = model.loss(*data[0])
        state.commit_forward()
    with pytest.raises(StateTransitionError, match="found no state"):
        loss.backward()


def test_the_blocks_of_a_model_share_one_compiled_graph():
    """The op names its module by a key tensor (a graph input), not by a per-module constant: a
    model's blocks (the same code) share one graph instead of recompiling per block (and
    falling back to eager past dynamo's recompile limit of 8)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=10, n_heads=2))
    state = f8s.Fp8State(f8s.QuantConfig(mode="safe", strict=True))
    state.convert(model)
    torch._dynamo.reset()
    counters.clear()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    x = torch.randint(0, 64, (2, 32))
    for step in range(2):
        with state.step(step):
            loss = model.loss(x, x)
            state.commit_forward()
            loss.backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert not state.ledger.violations


def test_a_whole_compiled_model_with_checkpointed_blocks_is_bitwise_the_eager_run():
    """``torch.compile(model)``: the checkpoint wrapper (a region frame, torch's checkpoint) runs
    inside the compiled model; every step's loss and gradients equal the eager run's."""

    def go(compiled: bool):
        model, state, data = _gpt(False, True)
        torch._dynamo.reset()
        fn = torch.compile(model, backend="aot_eager") if compiled else model
        out = []
        for step, (x, y) in enumerate(data):
            with state.step(step):
                loss = F.cross_entropy(fn(x).float().flatten(0, 1), y.flatten())
                state.commit_forward()
                loss.backward()
            out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
            model.zero_grad(set_to_none=True)
        assert not state.ledger.violations
        return out

    for i, (a, b) in enumerate(zip(go(False), go(True), strict=True)):
        assert bitwise_equal(a, b), i


class TwoSites(nn.Module):
    """One linear called at two sites: ``lin(x) * 3 + lin(x * scale_second)``."""

    def __init__(self, scale_second: float) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale_second = scale_second

    def forward(self, x):
        return self.lin(x) * 3 + self.lin(x * self.scale_second if self.scale_second != 1 else x)


def _two_sites(scale_second: float, rows: int, backend: str | None):
    """Three events of :class:`TwoSites` (compiled with ``backend``, or eager): each event's
    output and gradients (input's included), and the owners registered."""
    torch.manual_seed(0)
    model = TwoSites(scale_second)
    state = f8s.Fp8State(f8s.QuantConfig(mode="safe", strict=True))
    state.convert(model)
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    out = []
    for step in range(3):
        x = (torch.randn(rows, 16, generator=torch.Generator().manual_seed(step)) * (step + 1)).requires_grad_()
        with state.step(step):
            y = fn(x)
            state.commit_forward()
            y.sum().backward()
        out += [y.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
        model.zero_grad(set_to_none=True)
    assert not state.ledger.violations
    return out, len(state.protocol.bank.index)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(
    ("scale_second", "rows"),
    [(1.0, 8), (2.0, 0)],
    ids=["same-input", "empty-batches"],
)
def test_two_calls_of_a_layer_stay_two_calls(backend, scale_second, rows):
    """Two call sites, two owners each, as eagerly, outputs and gradients bitwise the eager run's.
    - The same input at both sites: AOTAutograd's common-subexpression elimination merged the two
      identical op calls into one, whose one kept state the second backward then lacked; each
      call now carries its own ``instance``.
    - Empty batches: the calls' states are kept under their codes' addresses, which empty
      tensors share (0); empty codes now get a storage of their own."""
    (eager, owners_e), (compiled, owners_c) = (
        _two_sites(scale_second, rows, None),
        _two_sites(scale_second, rows, backend),
    )
    assert owners_e == owners_c == 6  # two sites x (input, weight, grad_output)
    for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        assert a is not None and b is not None and bitwise_equal(a, b), i


def test_the_ops_are_kept_out_of_inductors_cuda_graphs():
    """Both ops run the protocol's Python on every call; a replay of Inductor's own CUDA graphs
    (mode="reduce-overhead") would skip it. Their tag keeps them out (GraphedStep, which replays
    the bookkeeping, is the way to graph a step of ours)."""
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip(f"torch {torch.__version__} has no cudagraph_unsafe tag")
    for op in (torch.ops.fp8state.fp8_linear.default, torch.ops.fp8state.fp8_linear_backward.default):
        assert torch.Tag.cudagraph_unsafe in op.tags, op


def test_the_saturation_counts_are_the_same_under_compile():
    """The quantize ops add to the bank's saturation counters in place (a mutated argument of
    the op, functionalized by the compiler): a compiled run counts exactly what the eager run does."""

    def go(compiled: bool):
        model, state, data = _gpt(False, True)
        if compiled:
            torch._dynamo.reset()
            for block in model.blocks:
                block.compile(backend="aot_eager")
        for step, (x, y) in enumerate(data):
            with state.step(step):
                loss = model.loss(x, y)
                state.commit_forward()
                loss.backward()
        return state.protocol.bank.saturation.clone()

    eager, compiled = go(False), go(True)
    assert torch.equal(eager, compiled)
    assert eager.shape[1] == (2 * 4 + 1) * 3 and bool((eager[1] > 0).all())  # every owner counted
