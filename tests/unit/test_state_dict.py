"""Saving and restoring quantizer state: exact resume, weights_only, refusal of bad state."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal, event_inputs, make_stack, run_events

GOLDEN = Path(__file__).parent.parent / "golden" / "state_v1.pt"


def fresh(ckpt=("torch", False), **cfg):
    state = f8s.Fp8State(f8s.QuantConfig(**cfg))
    model = state.convert(make_stack(ckpt=ckpt))
    return state, model


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_roundtrip_mid_run_continues_bit_identically():
    xs = event_inputs(10)
    # uninterrupted run, with a plain SGD step after every event
    state_a, model_a = fresh()
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.01)
    outs_a, grads_a = [], []
    for i, x in enumerate(xs):
        o, g = run_events(state_a, model_a, [x], step0=i)
        opt_a.step()
        outs_a += o
        grads_a += g
    # interrupted after 5 events: save everything, rebuild from scratch, load, continue
    state_b, model_b = fresh()
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.01)
    for i, x in enumerate(xs[:5]):
        run_events(state_b, model_b, [x], step0=i)
        opt_b.step()
    saved = roundtrip({"quant": state_b.state_dict(), "model": model_b.state_dict()})
    state_c, model_c = fresh()
    model_c.load_state_dict(saved["model"])
    state_c.load_state_dict(saved["quant"])
    opt_c = torch.optim.SGD(model_c.parameters(), lr=0.01)
    for i, x in enumerate(xs[5:], start=5):
        o, g = run_events(state_c, model_c, [x], step0=i)
        opt_c.step()
        assert bitwise_equal(o[0], outs_a[i]), f"event {i} output differs after resume"
        for name in g[0]:
            assert bitwise_equal(g[0][name], grads_a[i][name]), f"event {i} grad {name}"
    assert bitwise_equal(state_c.bank.scales, state_a.bank.scales)
    assert bitwise_equal(state_c.bank.amax_history, state_a.bank.amax_history)
    owner = state_a.bank.owners[0]
    assert state_c.ledger.commits(owner) == state_a.ledger.commits(owner) == 10
    assert state_c.clock.last == (9, 0)


def test_resume_without_the_quantizer_state_would_differ():
    """The control for the test above: dropping the bank is not bit-identical."""
    xs = event_inputs(6)
    state_a, model_a = fresh()
    outs_a, _ = run_events(state_a, model_a, xs)
    state_b, model_b = fresh()
    run_events(state_b, model_b, xs[:3])
    state_c, model_c = fresh()
    outs_c, _ = run_events(state_c, model_c, xs[3:], step0=3)
    assert not bitwise_equal(outs_c[0], outs_a[3])


def test_state_dict_holds_only_tensors_and_plain_values():
    state, model = fresh()
    run_events(state, model, event_inputs(2))
    sd = state.state_dict()
    loaded = roundtrip(sd)  # weights_only=True accepts it
    assert loaded["format_version"] == f8s.STATE_FORMAT_VERSION

    def walk(v):
        if isinstance(v, dict):
            assert all(isinstance(k, str) for k in v)
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:
            assert v is None or isinstance(v, (torch.Tensor, int, float, str, bool)), type(v)

    walk(loaded)


def corrupt_cases():
    def drop(key):
        return lambda sd: sd.pop(key)

    def set_bank(key, value):
        return lambda sd: sd["bank"].__setitem__(key, value)

    return [
        ("version", lambda sd: sd.__setitem__("format_version", 99), "format_version 99"),
        ("no bank", drop("bank"), "'bank' is missing"),
        ("nan scale", lambda sd: sd["bank"]["scale"].__setitem__(0, float("nan")), "non-finite"),
        ("zero scale", lambda sd: sd["bank"]["scale"].__setitem__(0, 0.0), "zero"),
        ("short history", set_bank("amax_history", torch.zeros(3, 24)), "amax_history.*expected shape"),
        ("wrong dtype", set_bank("scale", torch.ones(24, dtype=torch.float64)), "'scale'.*float32"),
        ("bad owner", lambda sd: sd["bank"]["owners"].__setitem__(0, ["x"]), "bad owners"),
        ("bad clock", lambda sd: sd["clock"].__setitem__("last", [1]), "clock or ledger"),
        ("other config", lambda sd: sd["config"].__setitem__("history_len", 4), "history_len: saved 4, live 16"),
        ("other rank", lambda sd: sd.__setitem__("rank", 3), "rank 3"),
    ]


@pytest.mark.parametrize(("name", "mutate", "match"), corrupt_cases(), ids=[c[0] for c in corrupt_cases()])
def test_corrupt_or_mismatched_state_is_refused_and_live_state_untouched(name, mutate, match):
    state, model = fresh()
    run_events(state, model, event_inputs(3))
    sd = roundtrip(state.state_dict())
    mutate(sd)
    before = state.state_dict()
    with pytest.raises(f8s.StateLoadError, match=match):
        state.load_state_dict(sd)
    after = state.state_dict()
    for key in ("amax_history", "scale", "descale", "amax_pending"):
        assert torch.equal(before["bank"][key], after["bank"][key])
    assert before["clock"] == after["clock"]


def test_state_of_another_model_is_refused():
    state_a, model_a = fresh()
    run_events(state_a, model_a, event_inputs(1))
    state_b = f8s.Fp8State(f8s.QuantConfig())
    model_b = state_b.convert(make_stack(n=2, ckpt=("torch", False)))
    run_events(state_b, model_b, event_inputs(1))
    with pytest.raises(f8s.StateLoadError, match="different model"):
        state_b.load_state_dict(state_a.state_dict())


def test_save_or_load_inside_an_event_is_refused():
    state, model = fresh()
    run_events(state, model, event_inputs(1))
    sd = state.state_dict()
    with state.step(1):
        with pytest.raises(f8s.StateTransitionError, match="between events"):
            state.state_dict()
        with pytest.raises(f8s.StateTransitionError, match="between events"):
            state.load_state_dict(sd)


def test_golden_state_v1_loads_with_the_values_its_maker_fed_it():
    """tests/golden/state_v1.pt was written by tests/golden/make_state_v1.py from inputs
    with known amaxes; the expected values follow from the format definition, not from
    this code's output: scale = 448 / max(amax history), descale = 1 / scale."""
    saved = torch.load(GOLDEN, weights_only=True)
    state = f8s.Fp8State(f8s.QuantConfig(history_len=4))
    state.load_state_dict(saved)
    inp = f8s.OwnerKey("0", "input")
    idx = state.bank.index[inp]
    assert state.bank.amax_history[:, idx].tolist() == [8.0, 2.0, 4.0, 0.0]
    assert state.scale_of(inp).item() == 448.0 / 8.0
    assert torch.equal(state.bank.descale[idx], torch.tensor(1.0) / torch.tensor(56.0))
    assert state.clock.last == (2, 0)
    assert state.ledger.commits(inp) == 3


def test_a_state_of_fewer_layers_is_refused_whenever_it_is_loaded():
    """Issue 30: a 2-block state once loaded silently into a 3-block model when load_state_dict
    ran before convert, or before the first event (refused only once training had started)."""
    state_a = f8s.Fp8State(f8s.QuantConfig())
    run_events(state_a, state_a.convert(make_stack(n=2)), event_inputs(1))
    saved = state_a.state_dict()
    # loaded before convert: checked at convert, and discarded
    state_b = f8s.Fp8State(f8s.QuantConfig())
    state_b.load_state_dict(saved)
    with pytest.raises(f8s.StateLoadError, match=r"no state for the converted layers \['blocks.2.fc1'"):
        state_b.convert(make_stack(n=3))
    assert len(state_b.bank) == 0 and state_b.clock.last is None
    # converted first, loaded before the first event: refused, nothing changed
    state_c = f8s.Fp8State(f8s.QuantConfig())
    state_c.convert(make_stack(n=3))
    with pytest.raises(f8s.StateLoadError, match=r"no state for the converted layers \['blocks.2.fc1'"):
        state_c.load_state_dict(saved)
    assert len(state_c.bank) == 0 and state_c.clock.last is None


def test_after_a_load_restarting_the_step_count_names_the_step_to_continue_from():
    state_a, model_a = fresh()
    run_events(state_a, model_a, event_inputs(3))
    state_b, model_b = fresh()
    state_b.load_state_dict(state_a.state_dict())
    with pytest.raises(f8s.StateTransitionError, match=r"the next step is 3 .*range\(3, n\)"):
        run_events(state_b, model_b, event_inputs(1))
    run_events(state_b, model_b, event_inputs(1), step0=3)  # the resume loop the message shows
