"""The seed's checklist, items 1-3: forward vs recompute, gradients, commit counts.

Every test asserts the safe protocol passes AND the naive mode (the seed's defect) fails.
"""

from __future__ import annotations

import pytest

import lightning_fp8state as f8s
from tests.conftest import ENGINE_IDS, ENGINES, bitwise_equal, event_inputs, make_stack, run_events

N_EVENTS = 10


def audited_run(mode, ckpt, n_events=N_EVENTS, commit_forward=True, **cfg):
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False, **cfg))
    model = state.convert(make_stack(ckpt=ckpt))
    with f8s.RecomputeAuditor(state) as auditor:
        outs, grads = run_events(state, model, event_inputs(n_events), commit_forward=commit_forward)
    return state, auditor.report(), outs, grads


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_recompute_is_bit_identical_to_true_forward_in_safe_mode(ckpt):
    state, report, _, _ = audited_run("safe", ckpt)
    # Every event's checkpointed blocks were re-run, and each re-run matched bitwise.
    assert {r.event for r in report.rows if r.recomputed} == {(i, 0) for i in range(N_EVENTS)}
    assert report.recomputed >= 4 * N_EVENTS
    assert all(r.recompute_sha256 == r.forward_sha256 for r in report.rows if r.output_recomputed)
    assert all(r.operands_equal for r in report.rows)
    assert report.ok, report.format_table()
    assert state.ledger.ok


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_naive_mode_recompute_differs_from_true_forward(ckpt):
    _, report, _, _ = audited_run("naive", ckpt)
    assert not report.ok
    assert len(report.mismatches) >= N_EVENTS  # at least one layer per event diverged
    assert any(r.max_abs_diff > 0 for r in report.mismatches)
    kinds = {v.kind for v in report.violations}
    assert {"record_in_recompute", "second_commit"} <= kinds


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_checkpointed_gradients_equal_uncheckpointed_bitwise(ckpt):
    _, _, outs_ref, grads_ref = audited_run("safe", None)
    _, _, outs_ck, grads_ck = audited_run("safe", ckpt)
    for event, (g_ref, g_ck) in enumerate(zip(grads_ref, grads_ck, strict=False)):
        for name in g_ref:
            assert bitwise_equal(g_ref[name], g_ck[name]), f"event {event}: grad of {name} differs"
        assert bitwise_equal(outs_ref[event], outs_ck[event])


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_naive_checkpointed_gradients_diverge_from_uncheckpointed(ckpt):
    _, _, _, grads_ref = audited_run("naive", None)
    _, _, _, grads_ck = audited_run("naive", ckpt)
    differing = [
        (e, n)
        for e, (a, b) in enumerate(zip(grads_ref, grads_ck, strict=False))
        for n in a
        if not bitwise_equal(a[n], b[n])
    ]
    assert differing, "the naive defect should make checkpointed gradients differ"


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_exactly_one_commit_per_owner_per_event(ckpt):
    state, _, _, _ = audited_run("safe", ckpt)
    owners = state.bank.owners
    assert len(owners) == 4 * 2 * 3  # 4 blocks x 2 linears x (input, weight, grad_output)
    for event in [(i, 0) for i in range(N_EVENTS)]:
        per_event = state.ledger.event(event)
        assert set(per_event) == set(owners)
        for owner, rec in per_event.items():
            assert rec.commits == 1, (owner, event, rec)
            assert rec.observations == 1
            assert rec.recompute_records == 0
    for owner in owners:
        assert state.ledger.commits(owner) == N_EVENTS
    # the checkpointed layers were really re-entered (fc1 of each block; torch may stop early)
    reads = sum(rec.recompute_reads for e in state.ledger.events() for rec in state.ledger.event(e).values())
    assert reads >= 4 * 2 * N_EVENTS


def test_naive_mode_commits_again_on_every_recompute():
    state, _, _, _ = audited_run("naive", ("torch", False))
    recomputed_owner = next(o for o in state.bank.owners if o.layer == "blocks.0.fc1" and o.role == "input")
    assert state.ledger.commits(recomputed_owner, (3, 0)) == 2
    assert state.ledger.commits(recomputed_owner) == 2 * N_EVENTS


def test_naive_mode_raises_at_once_in_strict_mode():
    state = f8s.Fp8State(f8s.QuantConfig(mode="naive", strict=True))
    model = state.convert(make_stack(ckpt=("torch", False)))
    with pytest.raises(f8s.StateTransitionError, match="recorded an amax during recompute"):
        run_events(state, model, event_inputs(1))
    assert state.event is None  # the failed event was closed


def test_commit_forward_advances_live_state_before_recompute():
    """The case snapshots exist for: at recompute time the live scale has already moved."""
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(ckpt=("torch", False)))
    xs = event_inputs(3)
    run_events(state, model, xs[:2])
    owner = next(o for o in state.bank.owners if o.layer == "blocks.0.fc1" and o.role == "input")
    seen = {}

    class Spy:
        def observe(self, record, phase, output, snaps):
            if record.layer == "blocks.0.fc1":
                seen[phase] = (float(snaps["input"].scale), float(state.scale_of(owner)))

    state.protocol.auditors.append(Spy())
    run_events(state, model, xs[2:], step0=2)
    fwd_snap, fwd_live = seen[f8s.Phase.FORWARD]
    rec_snap, rec_live = seen[f8s.Phase.RECOMPUTE]
    assert fwd_snap == fwd_live  # nothing committed yet during the true forward
    assert rec_live != fwd_live  # commit_forward moved the live scale before backward
    assert rec_snap == fwd_snap  # recompute still used the true forward's scale


@pytest.mark.parametrize(
    "ckpt",
    [("plain", False), ("plain", True), ("plain_deepspeed", None)],
    ids=["torch-nonreentrant", "torch-reentrant", "deepspeed"],
)
def test_plain_checkpoint_without_the_wrapper_is_detected_and_served(ckpt):
    state, report, _, _ = audited_run("safe", ckpt)
    assert report.recomputed >= 4 * N_EVENTS
    assert report.ok, report.format_table()
    _, naive, _, _ = audited_run("naive", ckpt)
    assert not naive.ok


def test_early_stop_leaves_snapshots_unread_and_the_stash_is_released():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(ckpt=("torch", False)))
    with f8s.RecomputeAuditor(state) as auditor:
        run_events(state, model, event_inputs(2))
    rows = auditor.report().rows
    # torch's early stop: fc2 (the region's last op) never produces its output again; its
    # operands are recomputed (and compared by the auditor)
    assert not any(r.output_recomputed for r in rows if r.layer.endswith("fc2"))
    assert all(r.recomputed and r.operands_compared for r in rows if r.layer.endswith("fc2"))
    assert all(r.output_recomputed for r in rows if r.layer.endswith("fc1"))
    assert len(state.protocol.stash) == 0
    assert state.ledger.ok


@pytest.mark.parametrize("mode", ["safe", "naive"])
def test_device_auditor_agrees_with_the_host_auditor(mode):
    """The device-side auditor (no host copies) gives the host auditor's verdict per step."""
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    model = state.convert(make_stack(ckpt=ENGINES[0]))
    with f8s.RecomputeAuditor(state) as host, f8s.DeviceRecomputeAuditor(state) as device:
        run_events(state, model, event_inputs(N_EVENTS))
    mismatching, recomputed = device.series(N_EVENTS)
    report = host.report()
    for step in range(N_EVENTS):
        rows = [r for r in report.rows if r.event == (step, 0)]
        assert recomputed[step] == sum(r.recomputed > 0 for r in rows) > 0
        assert mismatching[step] == sum(not r.ok for r in rows)
    if mode == "safe":
        assert sum(mismatching) == 0
    else:
        assert all(m > 0 for m in mismatching)  # the defect shows in every event


def test_the_checkpoint_engine_travels_with_the_state_s_event():
    """An unnamed checkpoint() runs the engine of the state whose event is open; outside it,
    torch's. A region remembers what it resolved, so a recompute run where the binding is not
    visible (the autograd engine's device thread: a fresh context) resolves the same."""
    import contextvars

    import torch

    from lightning_fp8state.recompute import default_engine

    state = f8s.Fp8State(f8s.QuantConfig(), checkpoint_engine="deepspeed")
    other = f8s.Fp8State(f8s.QuantConfig())
    seen = []

    def body(x):
        seen.append((default_engine(), contextvars.Context().run(default_engine)))
        return x * 2

    assert default_engine() == "torch"
    with torch.no_grad():
        with state.step(0):
            f8s.checkpoint(body, torch.ones(2), engine="torch")
        with other.step(0):
            f8s.checkpoint(body, torch.ones(2))
        f8s.checkpoint(body, torch.ones(2))
    assert seen == [("deepspeed", "deepspeed"), ("torch", "torch"), ("torch", "torch")]
    assert default_engine() == "torch"
    with pytest.raises(RuntimeError), state.step(1):
        raise RuntimeError("an aborted event unbinds its engine too")
    assert default_engine() == "torch"
