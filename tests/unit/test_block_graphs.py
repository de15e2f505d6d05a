"""GraphedBlocks on the CPU, its graphs emulated (tests/graph_emulation.py: replays run the
recorded operators on the captured tensors, no Python per call): bitwise the eager checkpointed
run, one commit per owner per event, the naive defect still caught, and every refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.graphs import GraphedBlocks
from tests.conftest import Block, bitwise_equal
from tests.graph_emulation import EmulatedGraphBackend

D = 16
N_EVENTS = 7
WARMUP = 2


class Net(nn.Module):
    """A converted input layer (eager), three checkpointed blocks, a converted head (eager)."""

    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(D, gain=1.0 + i) for i in range(n_blocks))
        self.head = nn.Linear(D, 4)
        self.runner = None

    def forward(self, x):
        h = self.inp(x)
        if self.runner is not None:
            h = self.runner(h)
        else:
            for block in self.blocks:
                h = f8s.checkpoint(block, h, engine="torch", use_reentrant=False)
        return self.head(h)


def inputs(n=N_EVENTS, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, D, generator=g) * (1.5**i)).to(device) for i in range(n)]


def train(graphed: bool, mode="safe", recipe="fp8_delayed", accumulate=1, xs=None, device="cpu", backend=None):
    """N events of Net with SGD; ``backend``: the graphs' (the emulation on the CPU, CUDA's on a GPU)."""
    # the recipe's own formats (rowwise: E4M3 grad_output, _scaled_mm's rowwise scales take E4M3 only)
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, recipe=recipe, strict=False))
    model = state.convert(Net()).to(device)
    backend = EmulatedGraphBackend() if backend is None and device == "cpu" else backend
    if graphed:
        model.runner = GraphedBlocks(model.blocks, warmup=WARMUP, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs, grads = [], []
    for i, x in enumerate(xs or inputs(device=device)):
        step, mb = divmod(i, accumulate)
        with state.step(step, mb):
            y = model(x)
            loss = y.float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        outs.append(y.detach().clone())
        if mb == accumulate - 1:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return state, model, outs, grads, backend


# every other recipe: test_recipe_conformance.py (accumulating)
@pytest.mark.parametrize("recipe", ["fp8_delayed"])
@pytest.mark.parametrize("accumulate", [1, 2], ids=["no-accumulation", "accumulate-2"])
def test_replayed_blocks_train_bitwise_the_eager_checkpointed_run(recipe, accumulate):
    ref_state, ref_model, ref_outs, ref_grads, _ = train(False, recipe=recipe, accumulate=accumulate)
    state, model, outs, grads, backend = train(True, recipe=recipe, accumulate=accumulate)
    runner = model.runner
    assert runner.eager_calls == WARMUP and runner.replays == N_EVENTS - WARMUP
    # every replay ran the recorded graphs: one forward and one backward graph per block
    assert len(backend.graphs) == 2 * 3 and all(g.replays == N_EVENTS - WARMUP for g in backend.graphs)
    for i, (a, b) in enumerate(zip(ref_outs, outs, strict=True)):
        assert bitwise_equal(a, b), f"event {i}: output differs"
    for i, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
        for name in ga:
            assert bitwise_equal(ga[name], gb[name]), f"step {i}: grad of {name} differs"
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        assert bitwise_equal(p, q), name
    if recipe == "fp8_delayed":
        assert bitwise_equal(ref_state.bank.scales, state.bank.scales)
        assert bitwise_equal(ref_state.bank.amax_history, state.bank.amax_history)
    # the ledger counts the same per owner and event: one observation, one commit, the same
    # read-only recompute reads, nothing recorded in recompute
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


def test_the_naive_defect_is_caught_in_every_replayed_event():
    state, _, _, naive_grads, _ = train(True, mode="naive")
    _, _, _, safe_grads, _ = train(True, mode="safe")
    per_event = {}
    for v in state.ledger.violations:
        per_event.setdefault(v.event, set()).add(v.kind)
    replayed = [(i, 0) for i in range(WARMUP + 1, N_EVENTS)]
    for event in replayed:
        assert {"record_in_recompute", "second_commit"} <= per_event.get(event, set()), event
    assert any(not bitwise_equal(a[n], b[n]) for a, b in zip(safe_grads, naive_grads, strict=True) for n in a), (
        "the naive defect should change the gradients"
    )


def test_eval_runs_the_blocks_eagerly_without_touching_the_graphs():
    state, model, _, _, backend = train(True)
    replays = [g.replays for g in backend.graphs]
    x = inputs(1, seed=5)[0]
    with torch.no_grad():
        graphed_eval = model(x)
        model.runner = None
        plain_eval = model(x)
    assert bitwise_equal(graphed_eval, plain_eval)
    assert [g.replays for g in backend.graphs] == replays


def test_refusals_name_what_to_change():
    state, model, _, _, _ = train(True)
    runner = model.runner
    x = inputs(1)[0]
    with pytest.raises(f8s.StateTransitionError, match="outside a logical event"):
        model(x)
    with state.step(100):
        y = model(x)
        with pytest.raises(f8s.StateTransitionError, match="ran twice in event"):
            model(x)
        y.sum().backward()
    with state.step(101), pytest.raises(f8s.ConfigError, match=r"expected an input of shape \(8, 16\)"):
        model(torch.randn(4, D))
    with f8s.RecomputeAuditor(state), state.step(102), pytest.raises(f8s.ConfigError, match="an auditor is attached"):
        model(x)
    # the bank reallocated after the capture (a load, a new owner): the graphs would use old tensors
    state.load_state_dict(state.state_dict())
    with state.step(103), pytest.raises(f8s.StateTransitionError, match="reallocated after the capture"):
        model(x)
    assert runner.replays == N_EVENTS - WARMUP + 1
    with pytest.raises(f8s.ConfigError, match="warmup=0 is not allowed"):
        GraphedBlocks(model.blocks, warmup=0)
    with pytest.raises(f8s.ConfigError, match="blocks: expected a non-empty sequence"):
        GraphedBlocks([])


def test_blocks_that_draw_random_numbers_are_refused_at_the_warmup():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return x + self.drop(self.fc(x))

    state = f8s.Fp8State(f8s.QuantConfig())
    blocks = nn.ModuleList([Noisy()])
    state.convert(blocks)
    runner = GraphedBlocks(blocks, warmup=1, backend=EmulatedGraphBackend())
    with state.step(0), pytest.raises(f8s.ConfigError, match="draw random numbers"):
        runner(torch.randn(2, D, requires_grad=True))


def test_fresh_grads_leave_the_graphs_memory_in_one_aligned_buffer():
    """The replayed backward hands autograd its gradients out of the graph's static buffers: the
    same bits, in memory of their own (a later replay overwrites the static buffers), each at a
    16-byte-aligned offset of one new buffer; gradients of mixed dtypes are cloned one by one."""
    from lightning_fp8state.graphs.replay import _BlockGraphs

    graphs = _BlockGraphs(Block(D))
    g = torch.Generator().manual_seed(3)
    shapes = [(D, D), (5,), None, (3, 7), (0,), (D,)]  # odd sizes: padding between segments; None: frozen
    static = tuple(None if s is None else torch.randn(s, generator=g) for s in shapes)
    graphs.static_grad_params = static
    fresh = graphs.fresh_grads()
    assert [f is None for f in fresh] == [s is None for s in static]
    live = [(f, s) for f, s in zip(fresh, static, strict=True) if s is not None]
    assert all(torch.equal(f, s) and f.shape == s.shape for f, s in live)
    assert all(f.data_ptr() % 16 == 0 for f, _ in live if f.numel())
    bases = {f.untyped_storage().data_ptr() for f, _ in live}
    assert len(bases) == 1 and bases.isdisjoint({s.untyped_storage().data_ptr() for _, s in live})
    kept = [f.clone() for f, _ in live]
    for _, s in live:  # the next replay rewrites the static buffers
        s.add_(1.0)
    assert all(torch.equal(f, k) for (f, _), k in zip(live, kept, strict=True))
    # mixed dtypes: a clone each
    mixed = _BlockGraphs(Block(D))
    mixed.static_grad_params = (torch.randn(4, generator=g), torch.randn(4, generator=g).double())
    out = mixed.fresh_grads()
    assert [o.dtype for o in out] == [torch.float32, torch.float64]
    assert all(
        torch.equal(o, s) and o.data_ptr() != s.data_ptr() for o, s in zip(out, mixed.static_grad_params, strict=True)
    )


class WideBlock(Block):
    """Block with a wider inner layer: another gradient layout in the same chain."""

    def __init__(self, d: int, gain: float = 1.0) -> None:
        super().__init__(d, gain)
        self.fc1 = nn.Linear(d, 3 * d)
        self.fc2 = nn.Linear(3 * d, d)


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def test_blocks_of_one_layout_share_their_static_gradients_and_train_bitwise_the_eager_run():
    """The graphs' memory holds one block's parameter gradients per layout, not one per block (a
    Llama 1B's 16 layers held 3.6 GiB more than eager), and two input gradients, not one per
    block. A replay's gradients are copied out before the next block's replay, so sharing is
    exact: a stack of two layouts trains bitwise its eager checkpointed run."""
    _, model, _, _, _ = train(True)
    graphs = model.runner.graphs
    assert len(graphs) == 3
    shared = graphs[-1].static_grad_params  # the first block captured (the backwards run in reverse)
    assert all(g.static_grad_params is shared for g in graphs)
    assert len(_storages(g.static_grad_in for g in graphs)) == 2

    def mixed_net():
        net = Net(n_blocks=4)
        torch.manual_seed(5)
        net.blocks[1] = WideBlock(D, gain=2.0)
        net.blocks[2] = WideBlock(D, gain=3.0)
        return net

    def run(graphed: bool):
        state = f8s.Fp8State(f8s.QuantConfig(strict=False))
        model = state.convert(mixed_net())
        if graphed:
            model.runner = GraphedBlocks(model.blocks, warmup=WARMUP, backend=EmulatedGraphBackend())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        grads = []
        for i, x in enumerate(inputs()):
            with state.step(i):
                loss = model(x).float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, grads

    ref_model, ref_grads = run(False)
    model, grads = run(True)
    for i, (a, b) in enumerate(zip(ref_grads, grads, strict=True)):
        for name in a:
            assert bitwise_equal(a[name], b[name]), f"step {i}: grad of {name} differs"
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        assert bitwise_equal(p, q), name
    graphs = model.runner.graphs
    narrow, wide = (graphs[3], graphs[0]), (graphs[2], graphs[1])
    assert narrow[0].static_grad_params is narrow[1].static_grad_params
    assert wide[0].static_grad_params is wide[1].static_grad_params
    assert _storages(narrow[0].static_grad_params).isdisjoint(_storages(wide[0].static_grad_params))
    assert len(_storages(g.static_grad_in for g in graphs)) == 2
