"""Ownership: per-layer state under reverse-order recompute, the per_model defect,
weight tying (one state per call site) and concurrent entry."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal, event_inputs, make_stack, run_events

GAINS = [4.0**i for i in range(8)]  # layer magnitudes differ by up to 4**7


def run_deep(mode, ownership, strict=False, n_events=10):
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, ownership=ownership, strict=strict))
    model = state.convert(make_stack(n=8, gains=GAINS, ckpt=("torch", False)))
    order = []

    class Order:
        def observe(self, record, phase, output, snaps):
            if record.layer.endswith("fc1"):
                order.append((phase, int(record.layer.split(".")[1])))

    state.protocol.auditors.append(Order())
    with f8s.RecomputeAuditor(state) as auditor:
        run_events(state, model, event_inputs(n_events, scale_growth=1.2))
    return state, auditor.report(), order


def test_eight_layers_recompute_descending_per_layer_state_is_exact():
    state, report, order = run_deep("safe", "per_layer")
    first_event = order[: 2 * 8]
    assert [i for p, i in first_event if p is f8s.Phase.FORWARD] == list(range(8))
    assert [i for p, i in first_event if p is f8s.Phase.RECOMPUTE] == list(reversed(range(8)))
    assert report.ok, report.format_table()
    # 8 blocks x 2 Linears x 10 events compared; early stop ends each block's recompute inside
    # fc2, whose output is never rebuilt (compared at its quantized operands)
    assert report.recomputed == 8 * 2 * 10
    assert sum(r.output_recomputed for r in report.rows) == 8 * 10
    # each layer's input scale tracks its own magnitude: fmax / its own history max
    for i in range(8):
        owner = f8s.OwnerKey(f"blocks.{i}.fc1", "input")
        idx = state.bank.index[owner]
        expected = torch.tensor(448.0) / state.bank.amax_history[:, idx].max()
        assert torch.equal(state.scale_of(owner), expected)


def test_per_model_scope_with_naive_timing_breaks_reverse_recompute():
    _, report, _ = run_deep("naive", "per_model")
    assert not report.ok
    broken_layers = {r.layer for r in report.mismatches}
    assert len(broken_layers) >= 4


def test_per_model_scope_fails_closed_in_strict_mode():
    with pytest.raises(f8s.StateTransitionError, match="wrong owner"):
        run_deep("safe", "per_model", strict=True, n_events=1)


def test_per_model_scope_is_wrong_even_with_snapshots():
    """A snapshot faithfully preserves the wrong owner's value: recompute matches the
    forward, yet every layer was quantized with a scale made from other layers' amaxes."""
    shared_state, shared, _ = run_deep("safe", "per_model")
    own_state, own, _ = run_deep("safe", "per_layer")
    assert all(r.bit_identical for r in shared.rows)  # the snapshot did its job...
    assert not shared.ok  # ...but the ledger saw one owner entered by 8 layers
    assert {v.kind for v in shared.violations} == {"shared_owner"}
    assert own.ok
    # the shared input scale is set by the loudest layer; the quietest layer loses precision
    shared_scale = shared_state.scale_of(f8s.OwnerKey("*", "input"))
    own_scale = own_state.scale_of(f8s.OwnerKey("blocks.0.fc1", "input"))
    assert own_scale / shared_scale > 1000
    x = torch.randn(4096) * 0.5
    err = {}
    for name, scale in (("shared", shared_scale), ("own", own_scale)):
        q = f8s.ops.quantize_fp8(x, scale.reshape(1), torch.float8_e4m3fn)
        back = f8s.ops.dequantize_fp8(q, (1 / scale).reshape(1), torch.float32)
        err[name] = (back - x).abs().max().item()
    assert err["shared"] > 10 * err["own"]


def test_an_owner_snapshot_repairs_timing_only_when_ownership_is_right():
    """naive_snapshot: the seed's first fix (snapshot per owner before a per-call advance,
    replayed in recompute). With per-layer owners it makes recompute exact; with one owner
    for the model, every recompute replays the snapshot of the model's last call."""
    _, own, _ = run_deep("naive_snapshot", "per_layer")
    assert own.ok, own.format_table()
    _, shared, _ = run_deep("naive_snapshot", "per_model")
    assert not shared.ok
    broken = {int(r.layer.split(".")[1]) for r in shared.mismatches}
    assert broken == set(range(8))  # every fc1 recomputes with the last call's (blocks.7.fc2) snapshot


class Tied(nn.Module):
    """One Linear called twice per forward, each call in its own checkpoint region."""

    def __init__(self, d=16, wrapped=True):
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, d)
        self.wrapped = wrapped

    def forward(self, x):
        if self.wrapped:
            h = f8s.checkpoint(lambda t: torch.tanh(self.shared(t)), x)
            h = f8s.checkpoint(lambda t: torch.tanh(self.shared(t * 8.0)), h)
        else:
            from torch.utils.checkpoint import checkpoint

            h = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=False)
            h = checkpoint(lambda t: torch.tanh(self.shared(t * 8.0)), h, use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize("mode", ["safe", "naive"])
def test_weight_tying_gets_one_state_per_call_site(mode):
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    model = state.convert(Tied())
    with f8s.RecomputeAuditor(state) as auditor:
        run_events(state, model, event_inputs(10))
    report = auditor.report()
    sites = {o.site for o in state.bank.owners if o.layer == "shared"}
    assert sites == {0, 1}
    assert report.recomputed == 2 * 10
    if mode == "safe":
        assert report.ok, report.format_table()
        s0 = state.scale_of(f8s.OwnerKey("shared", "input", site=0))
        s1 = state.scale_of(f8s.OwnerKey("shared", "input", site=1))
        assert s0 != s1  # the two call sites see different magnitudes and keep them apart
    else:
        assert not report.ok


def test_weight_tying_under_a_plain_checkpoint_is_ambiguous_and_says_how_to_fix():
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(Tied(wrapped=False))
    with pytest.raises(f8s.AmbiguousRecomputeError, match="lightning_fp8state.checkpoint"):
        run_events(state, model, event_inputs(1))
    assert state.event is None and len(state.protocol.stash) == 0


def _threaded_forward(state, layer, xs):
    results, errors = [None] * len(xs), []
    barrier = threading.Barrier(len(xs))

    def work(i):
        try:
            barrier.wait()
            results[i] = layer(xs[i])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def test_second_thread_entering_an_owner_in_flight_fails_closed():
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig(ownership="per_layer_rank"))
    model = state.convert(nn.Sequential(nn.Linear(16, 16)))
    xs = [torch.randn(4, 16), torch.randn(4, 16) * 3]
    with pytest.raises(f8s.ConcurrentEntryError, match="per_layer_rank_stream"):
        with state.step(0):
            _, errors = _threaded_forward(state, model, xs)
            if errors:
                raise errors[0]


def test_stream_ownership_gives_each_thread_its_own_state_equal_to_sequential_runs():
    """Two persistent workers (CPU threads stand in for CUDA streams) run sub-batches
    through the same layer in the same events; each must behave exactly as if it ran
    alone on its own state."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16))
    n_events = 4
    xs = [event_inputs(n_events, seed=s) for s in (5, 6)]
    state = f8s.Fp8State(f8s.QuantConfig(ownership="per_layer_rank_stream"))
    model = state.convert(base)
    outs = [[None] * n_events for _ in range(2)]
    start, done = threading.Barrier(3), threading.Barrier(3)
    errors = []

    def worker(i):
        for e in range(n_events):
            start.wait()
            try:
                outs[i][e] = model(xs[i][e]).detach()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
            done.wait()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in range(n_events):
        with state.step(e):
            start.wait()
            done.wait()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({o.stream for o in state.bank.owners}) == 2
    for i in range(2):
        torch.manual_seed(0)
        solo = f8s.Fp8State(f8s.QuantConfig())
        solo_model = solo.convert(nn.Sequential(nn.Linear(16, 16)))
        for e in range(n_events):
            with solo.step(e):
                y = solo_model(xs[i][e]).detach()
            assert bitwise_equal(y, outs[i][e]), (i, e)


def test_owner_key_hash_is_cached_and_pickles_by_value():
    import pickle  # noqa: PLC0415

    from lightning_fp8state.state import OwnerKey  # noqa: PLC0415

    key = OwnerKey("blocks.0.fc", "input", 1, 0, 2)
    assert hash(key) == hash(OwnerKey("blocks.0.fc", "input", 1, 0, 2))
    assert key == OwnerKey("blocks.0.fc", "input", 1, 0, 2) and key != OwnerKey("blocks.0.fc", "input", 1, 0, 3)
    state = key.__getstate__()
    assert state == {"layer": "blocks.0.fc", "role": "input", "rank": 1, "stream": 0, "site": 2}  # no hash
    back = pickle.loads(pickle.dumps(key))
    assert back == key and hash(back) == hash(key) and {back: 1}[key] == 1
    assert sorted([OwnerKey("b", "x"), OwnerKey("a", "y")])[0].layer == "a"  # still ordered
