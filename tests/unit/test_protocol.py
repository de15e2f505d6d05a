"""Pairing, stamps, non-finite input, the bf16 control and the protocol's fail-closed edges."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state import ops
from tests.conftest import bitwise_equal, event_inputs, make_stack, run_events

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def one_linear(mode="safe", **cfg):
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False, **cfg))
    model = state.convert(nn.Sequential(nn.Linear(32, 16, bias=False)))
    return state, model


def expected_linear_event(x, w, scale_x, scale_w, scale_g):
    """The FP8 linear computed by hand from known scales, with the paired descales. A scale
    of None is calibrated from the tensor itself (fmax / its amax: an owner's first event)."""
    one = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    own = lambda fmax, t: (torch.tensor(fmax) / t.float().abs().max()).item()  # noqa: E731
    scale_x = own(448.0, x) if scale_x is None else scale_x
    scale_w = own(448.0, w) if scale_w is None else scale_w
    xq = ops.quantize_fp8_reference(x, one(scale_x), E4M3)
    wq = ops.quantize_fp8_reference(w, one(scale_w), E4M3)
    dx, dw = 1 / one(scale_x), 1 / one(scale_w)
    y = ((xq.float() @ wq.float().t()) * (dx * dw)).to(x.dtype)
    g = (2 * y.float() / y.numel()).to(y.dtype)  # d mean(y^2) / dy
    scale_g = own(57344.0, g) if scale_g is None else scale_g
    gq = ops.quantize_fp8_reference(g, one(scale_g), E5M2)
    dg = 1 / one(scale_g)
    grad_w = ((gq.float().t() @ xq.float()) * (dg * dx)).to(w.dtype)
    return y, grad_w


@pytest.mark.parametrize("mode", ["safe", "safe_initial_one", "naive"])
def test_consumer_reads_the_descale_paired_with_its_data(mode):
    """quantize -> commit -> GEMM consumer: commit_forward moves live state before the
    backward GEMMs run; the consumer must still use the descale the data was encoded with.
    The expected output and weight gradient are computed by hand from the delayed-scaling
    definition (scale = fmax / max of earlier amaxes; before any history: fmax / the call's
    own amax with initial_scale="calibrate", 1 with "one" and in the naive mode)."""
    calibrate = mode == "safe"
    if mode == "safe_initial_one":
        state, model = one_linear("safe", initial_scale="one")
    else:
        state, model = one_linear(mode)
    w = model[0].weight.detach().clone()
    xs = event_inputs(4, d=32)
    amax = {"x": [], "g": []}

    def scale(fmax, hist):
        if not hist:
            return None if calibrate else 1.0
        return (torch.tensor(fmax) / torch.stack(hist).max()).item()

    matches = []
    for step, x in enumerate(xs):
        model.zero_grad()
        with state.step(step):
            y = model(x)
            loss = y.float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        exp_y, exp_gw = expected_linear_event(
            x,
            w,
            scale(448.0, amax["x"]),
            (torch.tensor(448.0) / w.abs().max()).item() if step or calibrate else 1.0,
            scale(57344.0, amax["g"]),
        )
        matches.append(bitwise_equal(y.detach(), exp_y) and bitwise_equal(model[0].weight.grad, exp_gw))
        amax["x"].append(x.abs().max())
        amax["g"].append((2 * exp_y / exp_y.numel()).abs().max())
    if mode != "naive":
        assert all(matches), matches
    else:
        assert not any(matches), "naive mode must consume the descale advanced for the next call"


def test_backward_reads_grad_output_once_for_codes_transpose_and_bias():
    """The grad_output's one encode (CastTranspose) gives the bias gradient as its column sums
    in the kernel's order, and its transposed codes feed the weight gradient: the gradients
    equal the hand computation from the separately quantized grad_output."""
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(nn.Sequential(nn.Linear(32, 48)))
    x = torch.randn(300, 32)
    r = torch.randn(300, 48)  # d (y * r).sum() / dy
    with state.step(0):
        y = model(x)
        state.commit_forward()
        (y * r).sum().backward()
    assert torch.equal(model[0].bias.grad, ops.column_sum_reference(r))
    owner = f8s.OwnerKey("0", "grad_output")
    assert torch.equal(state.bank.amax_history[0, state.bank.index[owner]], r.abs().max())
    scale_x = torch.tensor([448.0]) / x.abs().max()
    scale_g = torch.tensor([57344.0]) / r.abs().max()
    xq = ops.quantize_fp8_reference(x, scale_x, E4M3)
    gq = ops.quantize_fp8_reference(r, scale_g, E5M2)
    grad_w = ((gq.float().t() @ xq.float()) * ((1 / scale_g) * (1 / scale_x))).to(torch.float32)
    assert torch.equal(model[0].weight.grad, grad_w)


def test_snapshot_values_match_hand_computed_delayed_scales():
    state, model = one_linear()
    xs = event_inputs(4, d=32, scale_growth=2.0)
    run_events(state, model, xs)
    owner = f8s.OwnerKey("0", "input")
    amaxes = [x.abs().max() for x in xs]
    idx = state.bank.index[owner]
    # history holds each event's amax, newest first; scale is fmax / max(history)
    assert torch.equal(state.bank.amax_history[:4, idx], torch.stack(amaxes[::-1]))
    assert torch.equal(state.scale_of(owner), torch.tensor(448.0) / torch.stack(amaxes).max())
    assert torch.equal(state.bank.descale[idx], 1 / state.scale_of(owner))


def test_most_recent_algo_and_margin():
    state, model = one_linear(amax_algo="most_recent", margin=2)
    xs = event_inputs(3, d=32, scale_growth=0.25)  # shrinking: max and most_recent differ
    run_events(state, model, xs)
    owner = f8s.OwnerKey("0", "input")
    assert torch.equal(state.scale_of(owner), torch.tensor(448.0) / xs[-1].abs().max() / 4.0)


def test_stamps_refuse_another_step_layer_or_role():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    captured = {}

    class Grab:
        def observe(self, record, phase, output, snaps):
            captured[record.layer] = (record, snaps)

    state.protocol.auditors.append(Grab())
    with state.step(0):
        model(torch.randn(2, 8)).sum().backward()
    rec0, snaps0 = captured["0"]
    rec1, _ = captured["1"]
    snap = snaps0["input"]
    assert snap.expect(owner=rec0.owners["input"], event=(0, 0), layer="0", role="input") is snap
    with pytest.raises(f8s.StaleSnapshotError, match="event"):
        snap.expect(event=(1, 0))
    with pytest.raises(f8s.StaleSnapshotError, match="owner"):
        snap.expect(owner=rec1.owners["input"])
    with pytest.raises(f8s.StaleSnapshotError, match="layer"):
        snap.expect(layer="1")
    with pytest.raises(f8s.StaleSnapshotError, match="role"):
        snap.expect(role="weight")


def test_stamped_snapshot_is_the_constructed_one_and_check_consumer_refuses_another_call():
    import dataclasses

    from lightning_fp8state.state import OwnerKey, QuantSnapshot

    owner, s = OwnerKey("a", "input"), torch.ones(())
    args = (owner, 3, 1, ("region", 0), 2, torch.float8_e4m3fn, s, s * 2, None, None)
    fast, built = QuantSnapshot.stamped(*args), QuantSnapshot(*args)
    assert [getattr(fast, f.name) for f in dataclasses.fields(QuantSnapshot)] == [
        getattr(built, f.name) for f in dataclasses.fields(QuantSnapshot)
    ]
    assert set(vars(fast)) == {f.name for f in dataclasses.fields(QuantSnapshot)} and repr(fast) == repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.step = 4
    # a stateless call's snapshot (with_scales): dataclasses.replace's result, as frozen, the original untouched
    scale, descale, amax = torch.full((2, 1), 4.0), torch.full((2, 1), 0.25), torch.full((2, 1), 112.0)
    quick, slow = (
        fast.with_scales(scale, descale, amax),
        dataclasses.replace(fast, scale=scale, descale=descale, amax=amax),
    )
    assert [getattr(quick, f.name) for f in dataclasses.fields(QuantSnapshot)] == [
        getattr(slow, f.name) for f in dataclasses.fields(QuantSnapshot)
    ]
    assert type(quick) is QuantSnapshot and repr(quick) == repr(slow) and fast.amax is None and fast.scale is s
    with pytest.raises(dataclasses.FrozenInstanceError):
        quick.amax = None
    # the consumer check (its fast path and the fallback) on a real call's record, in two events
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    captured = {}

    class Grab:
        def observe(self, record, phase, output, snaps):
            captured[record.layer] = (record, dict(snaps))

    state.protocol.auditors.append(Grab())
    for step in range(2):
        with state.step(step):
            model(torch.randn(2, 8)).sum().backward()
            rec0, snaps0 = captured["0"]
            rec1, snaps1 = captured["1"]
            assert rec0.owners is not rec1.owners and rec0.owners["input"] != rec1.owners["input"]
            assert state.protocol.check_consumer(rec0, "input", snaps0["input"]) is snaps0["input"]
            with pytest.raises(f8s.StaleSnapshotError, match="owner"):
                state.protocol.check_consumer(rec0, "input", snaps1["input"])
            with pytest.raises(f8s.StaleSnapshotError, match="owner"):
                state.protocol.check_consumer(rec0, "weight", snaps0["input"])
        stale = snaps0["input"]
    with state.step(2):
        model(torch.randn(2, 8)).sum().backward()
        rec0, _ = captured["0"]
        with pytest.raises(f8s.StaleSnapshotError, match="event"):
            state.protocol.check_consumer(rec0, "input", stale)


def test_backward_in_a_later_event_is_refused():
    state, model = one_linear()
    with state.step(0):
        y = model(torch.randn(4, 32))
    with pytest.raises(f8s.StateTransitionError, match="outside a logical event"):
        y.sum().backward(retain_graph=True)
    with pytest.raises(f8s.StaleSnapshotError, match=r"\(0, 0\)"):
        with state.step(1):
            y.sum().backward()


def test_snapshots_never_change_after_commit():
    state, model = one_linear()
    grabbed = []

    class Grab:
        def observe(self, record, phase, output, snaps):
            grabbed.append((snaps["input"], snaps["input"].scale.clone()))

    state.protocol.auditors.append(Grab())
    run_events(state, model, event_inputs(3, d=32))
    for snap, value in grabbed:
        assert torch.equal(snap.scale, value)
        assert snap.scale.data_ptr() != state.bank.scale.data_ptr()


def test_every_snapshot_scale_sits_at_a_16_byte_aligned_address():
    """cuBLASLt's FP8 GEMM (torch._scaled_mm) refuses scale pointers that are not 16-byte
    aligned (CUBLAS_STATUS_NOT_SUPPORTED on the H200 at a 4-byte offset), and the GEMM reads
    the snapshots' cells directly; tests/gpu/test_linear_cuda.py runs _scaled_mm on them."""
    state, model = one_linear()
    snaps = []

    class Grab:
        def observe(self, record, phase, output, snaps_of_call):
            snaps.extend(snaps_of_call.values())

    state.protocol.auditors.append(Grab())
    run_events(state, model, event_inputs(2, d=32))
    assert len(snaps) >= 4
    for snap in snaps:
        assert snap.scale.data_ptr() % 16 == 0 and snap.descale.data_ptr() % 16 == 0


def test_nonfinite_input_does_not_poison_history_and_is_flagged():
    state, model = one_linear()
    xs = event_inputs(6, d=32)
    xs[2] = xs[2].clone()
    xs[2][0, 3] = float("nan")
    xs[2][1, 4] = float("inf")
    outs, grads = run_events(state, model, xs)
    owner = f8s.OwnerKey("0", "input")
    assert not torch.isfinite(outs[2]).all()  # the poisoned event itself shows it
    for e in (3, 4, 5):
        assert torch.isfinite(outs[e]).all(), f"event {e} output was poisoned"
    assert torch.isfinite(state.bank.amax_history).all()
    assert torch.isfinite(state.bank.scales).all() and (state.bank.scales > 0).all()
    counts = state.nonfinite_counts()
    assert counts[owner] == 1
    # the weight owner saw only finite data
    assert counts[f8s.OwnerKey("0", "weight")] == 0
    # history skipped the bad event: it holds exactly the 5 finite amaxes
    idx = state.bank.index[owner]
    finite = [x.abs().max() for i, x in enumerate(xs) if i != 2]
    assert torch.equal(state.bank.amax_history[:5, idx], torch.stack(finite[::-1]))


def test_bf16_control_has_no_quantizer_state_and_recomputes_identically():
    state = f8s.Fp8State(f8s.QuantConfig(recipe="bf16"))
    model = state.convert(make_stack(ckpt=("torch", False)))
    plain = make_stack(ckpt=None)  # same seed, plain nn.Linear layers
    xs = [x.bfloat16() for x in event_inputs(10)]
    model.bfloat16()
    plain.bfloat16()
    with f8s.RecomputeAuditor(state) as auditor:
        outs, grads = run_events(state, model, xs)
    report = auditor.report()
    assert report.ok and report.recomputed >= 10
    assert len(state.bank) == 0 and state.bank.amax_history.numel() == 0
    assert state.ledger.owners() == []
    for x, y in zip(xs, outs, strict=False):
        assert bitwise_equal(plain(x).detach(), y)


def test_training_forward_outside_an_event_fails_closed_and_no_grad_eval_is_read_only():
    state, model = one_linear()
    run_events(state, model, event_inputs(2, d=32))
    with pytest.raises(f8s.StateTransitionError, match="state.step"):
        model(torch.randn(2, 32))
    before = state.bank.state_dict()
    with torch.no_grad():
        y = model(torch.randn(2, 32))
    assert torch.isfinite(y).all()
    after = state.bank.state_dict()
    for key in ("amax_history", "scale", "amax_pending"):
        assert torch.equal(before[key], after[key])


def test_events_only_move_forward():
    state, model = one_linear()
    run_events(state, model, event_inputs(1, d=32), step0=5)
    with pytest.raises(f8s.StateTransitionError, match="not after"):
        with state.step(5):
            pass
    with pytest.raises(f8s.StateTransitionError, match="not after"):
        with state.step(4, microbatch=3):
            pass
    with state.step(5, microbatch=1):
        pass
    with state.step():  # no step given: the next one
        assert state.event == (6, 0)
    with pytest.raises(f8s.StateTransitionError, match="still open"):
        with state.step(10), state.step(11):
            pass


def test_an_event_that_raises_commits_nothing():
    state, model = one_linear()
    run_events(state, model, event_inputs(1, d=32))
    before = state.bank.state_dict()
    with pytest.raises(RuntimeError, match="boom"):
        with state.step(1):
            model(torch.randn(4, 32) * 100).sum()
            raise RuntimeError("boom")
    after = state.bank.state_dict()
    for key in ("amax_history", "scale", "descale", "amax_pending"):
        assert torch.equal(before[key], after[key]), key
    assert state.event is None and len(state.protocol.stash) == 0


def test_commit_forward_outside_an_event_is_an_error():
    state, _ = one_linear()
    with pytest.raises(f8s.StateTransitionError, match="inside `with state.step"):
        state.commit_forward()


def test_convert_reports_and_filters_and_shares_parameters():
    state = f8s.Fp8State(f8s.QuantConfig(include=("blocks.*",), exclude=("*.fc2",)))
    model = make_stack(n=2)
    params_before = [id(p) for p in model.parameters()]
    state.convert(model)
    report = state.last_conversion
    assert report.converted == ["blocks.0.fc1", "blocks.1.fc1"]
    assert set(report.skipped) == {"blocks.0.fc2", "blocks.1.fc2"}
    assert isinstance(model.blocks[0].fc1, f8s.Fp8Linear)
    assert type(model.blocks[0].fc2) is nn.Linear
    assert [id(p) for p in model.parameters()] == params_before
    state.convert(model)  # converting twice changes nothing
    assert state.last_conversion.converted == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"recipe": "fp9"}, "recipe='fp9'.*fp8_delayed"),
        ({"mode": "careful"}, "mode='careful'.*safe"),
        ({"amax_algo": "mean"}, "amax_algo='mean'.*most_recent"),
        ({"ownership": "global"}, "ownership='global'.*per_layer"),
        ({"history_len": 0}, "history_len=0.*>= 1"),
        ({"margin": -1}, "margin=-1.*>= 0"),
        ({"history_len": 2.5}, "history_len=2.5"),
        ({"strict": "yes"}, "strict='yes'"),
        ({"forward_format": "e3m4"}, "forward_format"),
        ({"gemm": "cublas"}, "gemm='cublas'"),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(kwargs, match):
    # QuantConfig checks its own keys; the recipe registry (beside the recipes) checks the recipe
    # name and its modes when a state is built from it
    with pytest.raises(f8s.ConfigError, match=match):
        f8s.Fp8State(f8s.QuantConfig(**kwargs))


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(f8s.ConfigError, match=r"unknown QuantConfig keys \['histroy_len'\]"):
        f8s.QuantConfig.from_dict({"histroy_len": 4})
    assert f8s.QuantConfig.from_dict({"history_len": 4}).history_len == 4


def test_unknown_checkpoint_engine_is_a_config_error():
    with pytest.raises(f8s.ConfigError, match="engine='megatron'"):
        f8s.checkpoint(lambda t: t, torch.randn(2), engine="megatron")


def test_errors_subclass_the_nearest_builtin():
    assert issubclass(f8s.ConfigError, ValueError)
    assert issubclass(f8s.StateLoadError, ValueError)
    for err in (
        f8s.StateTransitionError,
        f8s.ConcurrentEntryError,
        f8s.StaleSnapshotError,
        f8s.AmbiguousRecomputeError,
    ):
        assert issubclass(err, RuntimeError)


def test_an_owner_first_seen_under_inference_mode_trains_afterwards():
    """Lightning's sanity check runs validation under torch.inference_mode before any training
    step: the owners registered there must not make the bank inference tensors, which the first
    commit would then refuse to update in place."""
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(n=1))
    with torch.inference_mode():
        model(torch.randn(2, 16))
    assert not state.bank.amax_history.is_inference()
    with state.step(0):
        model(torch.randn(2, 16)).float().pow(2).mean().backward()
    assert all(state.ledger.commits(o) == 1 for o in state.bank.owners)


def test_an_entrant_s_cached_owners_follow_the_bank_when_it_changes():
    """The per-entrant cache (CallRecords._entrant, protocol/records.py) is keyed by the bank's version: a later
    registration, a load into a fresh state and a reset all give indices of the bank in use."""
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    captured = {}

    class Grab:
        def observe(self, record, phase, output, snaps):
            captured[record.layer] = record

    state.protocol.auditors.append(Grab())

    def check(step, run):
        with state.step(step):
            run(torch.randn(2, 8)).sum().backward()
        bank = state.protocol.bank
        for rec in captured.values():
            assert rec.indices == {role: bank.index[o] for role, o in rec.owners.items()}

    with pytest.warns(f8s.ConversionWarning, match="1"):  # (the second layer did not run yet)
        check(0, model[0])  # only the first layer: its owners registered
    check(1, model)  # the second registers (the bank grows): the first's cached indices are re-derived
    saved = state.state_dict()
    state.protocol.reset()
    check(2, model)
    state.protocol.reset()
    state.load_state_dict(saved)
    check(3, model)
