"""A weight's FP8 codes are made once per event (fp8_delayed): the true forward encodes the
weight with its transpose in one pass, the recompute reuses those codes (same parameter, same
snapshot), and the backward reads the transpose, so it transposes no weight.

What must not change: the recompute stays bitwise the true forward, gradients stay bitwise the
un-checkpointed run's, a weight changed in place between forward and recompute is encoded
again (and the auditor sees the difference), SAC still sees the same op sequence in both runs,
and the naive modes still reproduce their defects.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_fp8state as f8s
from tests.conftest import ENGINE_IDS, ENGINES, bitwise_equal, event_inputs, make_stack, run_events

_f8 = torch.ops.fp8state
N_BLOCKS = 4
N_LINEARS = 2 * N_BLOCKS


class _OpCounter(TorchDispatchMode):
    """Counts the fp8state ops issued under it (by overload name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fp8state":
            self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _one_event(state, model, x, step=0):
    x = x.clone().requires_grad_(True)
    counter = _OpCounter()
    with counter, state.step(step):
        y = model(x)
        state.commit_forward()
        y.float().pow(2).mean().backward()
    return counter.counts


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_the_recompute_reuses_the_weight_codes_and_the_backward_transposes_no_weight(ckpt):
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_stack(n=N_BLOCKS, ckpt=ckpt))
    x0, x1 = event_inputs(2)
    _one_event(state, model, x0, 0)  # the first event also calibrates the scales (more ops)
    counts = _one_event(state, model, x1, 1)
    # per linear: the weight's codes with their transpose (forward) and grad_output's (backward)
    assert counts["quantize_fp8_t_record_amax.default"] == 2 * N_LINEARS, counts
    # per linear: the input's codes in the forward and in the recompute, the weight's never alone
    assert counts["quantize_fp8_record_amax.default"] == 2 * N_LINEARS, counts
    # (the transposes the GPU's GEMM needs are counted on the GPU: tests/gpu/test_weight_codes_cuda.py)


def test_weight_codes_once_false_encodes_the_weight_at_every_run():
    """``QuantConfig(weight_codes_once=False)`` (benchmarks/train_step.py's ``safe_percall_w``,
    the A/B of this change): the weight is encoded plainly in the forward and again in the
    recompute, and the result is bitwise the same."""
    xs = event_inputs(3)

    def run(once):
        state = f8s.Fp8State(f8s.QuantConfig(strict=False, weight_codes_once=once))
        assert state.protocol.recipe.weight_codes_once is once
        model = state.convert(make_stack(n=N_BLOCKS, ckpt=("torch", False)))
        outs, grads = run_events(state, model, xs[:2])
        return _one_event(state, model, xs[2], 2), outs, grads

    counts, outs, grads = run(False)
    assert counts["quantize_fp8_t_record_amax.default"] == N_LINEARS, counts  # grad_output only
    assert counts["quantize_fp8_record_amax.default"] == 4 * N_LINEARS, counts  # input, weight: twice each
    _, outs_once, grads_once = run(True)
    for a, b in zip(grads, grads_once, strict=True):
        assert all(bitwise_equal(a[n], b[n]) for n in a)
    assert all(bitwise_equal(a, b) for a, b in zip(outs, outs_once, strict=True))


def test_without_checkpointing_the_weight_is_encoded_once_and_saved_transposed():
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_stack(n=N_BLOCKS))
    x0, x1 = event_inputs(2)
    _one_event(state, model, x0, 0)
    counts = _one_event(state, model, x1, 1)
    assert counts["quantize_fp8_t_record_amax.default"] == 2 * N_LINEARS, counts
    assert counts["quantize_fp8_record_amax.default"] == N_LINEARS, counts
    # what the backward reads of the weight: the transposed codes, as the [out, in] view of a
    # contiguous [in, out] tensor (the layout the input gradient's GEMM takes without a copy)
    fc = model.blocks[0].fc1
    with state.step(2):
        y = fc(event_inputs(1)[0])
        saved = [t for t in y.grad_fn.saved_tensors if t.dtype == torch.float8_e4m3fn]
        state.commit_forward()
    w_saved = [t for t in saved if t.shape == fc.weight.shape]
    assert len(w_saved) == 1 and w_saved[0].t().is_contiguous() and not w_saved[0].is_contiguous()


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_reused_codes_keep_recompute_and_gradients_bitwise(ckpt):
    def run(ck):
        state = f8s.Fp8State(f8s.QuantConfig(strict=False))
        model = state.convert(make_stack(n=N_BLOCKS, ckpt=ck))
        with f8s.RecomputeAuditor(state) as auditor:
            outs, grads = run_events(state, model, event_inputs(5))
        return auditor.report(), outs, grads, state

    _, outs_ref, grads_ref, _ = run(None)
    report, outs, grads, state = run(ckpt)
    assert report.ok, report.format_table()
    assert all(r.operands_equal for r in report.rows)
    assert report.recomputed >= N_BLOCKS * 5
    assert state.ledger.ok
    for event, (a, b) in enumerate(zip(grads_ref, grads, strict=True)):
        for name in a:
            assert bitwise_equal(a[name], b[name]), f"event {event}: the gradient of {name} differs"
        assert bitwise_equal(outs_ref[event], outs[event])


@pytest.mark.parametrize("mode", ["naive", "naive_snapshot"])
def test_the_naive_modes_encode_the_weight_again_in_the_recompute(mode):
    """The defects stay reproducible: a naive recompute quantizes again (and records)."""
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    model = state.convert(make_stack(n=N_BLOCKS, ckpt=("torch", False)))
    x0, x1 = event_inputs(2)
    _one_event(state, model, x0, 0)
    counts = _one_event(state, model, x1, 1)
    # forward and recompute each encode the weight (with its transpose), the backward grad_output
    assert counts["quantize_fp8_t_record_amax.default"] == 3 * N_LINEARS, counts
    if mode == "naive":  # its recompute records with a scale moved by the forward's commit
        with f8s.RecomputeAuditor(state) as auditor:
            run_events(state, model, event_inputs(3, seed=5), step0=2)
        assert not auditor.report().ok


def test_a_weight_changed_in_place_before_the_recompute_is_encoded_again():
    """The codes are reused only for the same parameter contents (its version): a weight edited
    between the true forward and the recompute is encoded afresh, so the auditor sees the
    recompute's different operand instead of the stale codes hiding it."""
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_stack(n=2, ckpt=("torch", False)))
    x0, x1 = event_inputs(2)
    _one_event(state, model, x0, 0)
    fc = model.blocks[1].fc1
    with f8s.RecomputeAuditor(state) as auditor, state.step(1):
        x = x1.clone().requires_grad_(True)
        y = model(x)
        state.commit_forward()
        with torch.no_grad():
            fc.weight.mul_(-3.0)  # bumps the version: the held codes no longer describe it
        y.float().pow(2).mean().backward()
    report = auditor.report()
    rows = [r for r in report.rows if r.layer.endswith("blocks.1.fc1")]
    assert rows and "weight" in rows[0].operand_mismatches, report.format_table()


def test_the_backward_releases_the_held_codes():
    """The codes held for the recompute are dropped by the call's backward, not kept to the
    event's end (they would cost a byte a parameter through the optimizer step)."""
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_stack(n=2, ckpt=("torch", False)))
    protocol = state.protocol
    held = []
    with state.step(0):
        y = model(event_inputs(1)[0])
        records = [r for rs in protocol.stash._by_layer.values() for r in rs]
        held.append(sum("weight_codes" in r.derived for r in records))
        state.commit_forward()
        y.float().pow(2).mean().backward()
        held.append(sum("weight_codes" in r.derived for r in records))
    assert held == [4, 0]


@pytest.mark.parametrize(
    ("ckpt", "kept"),
    [
        (None, 0),  # plain autograd: no recompute can come, the backward holds what it reads
        (("torch", False), 4),  # ours (a region frame)
        (("plain", False), 4),  # torch's non-reentrant checkpoint: its saved-tensor hooks
        (("plain", True), 4),  # torch's reentrant checkpoint: its forward runs without grad
        (("plain_deepspeed", None), 4),  # DeepSpeed's (reentrant) checkpoint
    ],
    ids=["none", "ours", "torch-nonreentrant", "torch-reentrant", "deepspeed"],
)
def test_codes_are_held_only_where_a_recompute_may_follow(ckpt, kept):
    """Without any checkpoint the held codes would add a byte a weight element to the peak for
    nothing (Mixtral's experts: 1.4 GB on the H200); every checkpoint keeps them. The trained
    results are bitwise the same either way (the un-checkpointed run against the checkpointed)."""
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_stack(n=2, ckpt=ckpt))
    protocol = state.protocol
    xs = event_inputs(3)
    run_events(state, model, xs[:2])
    with state.step(2):
        y = model(xs[2].clone().requires_grad_(True))
        records = [r for rs in protocol.stash._by_layer.values() for r in rs]
        assert sum("weight_codes" in r.derived for r in records) == kept
        state.commit_forward()
        y.float().pow(2).mean().backward()


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_a_recompute_without_held_codes_encodes_the_weight_again_bitwise(ckpt, monkeypatch):
    """Were a recompute to come where none was foreseen, it finds no held codes and encodes the
    weight again from its snapshot: bitwise what the run with held codes computes."""
    from lightning_fp8state.protocol import records

    runs = []
    for foresee in (True, False):
        if not foresee:
            monkeypatch.setattr(records, "recompute_may_follow", lambda region: False)
        state = f8s.Fp8State(f8s.QuantConfig(strict=False))
        model = state.convert(make_stack(n=2, ckpt=ckpt))
        xs = event_inputs(4)
        runs.append(run_events(state, model, xs[:3]))
        x = xs[3].clone().requires_grad_(True)
        with state.step(3):
            y = model(x)
            records_now = [r for rs in state.protocol.stash._by_layer.values() for r in rs]
            assert sum("weight_codes" in r.derived for r in records_now) == (4 if foresee else 0)
            state.commit_forward()
            y.float().pow(2).mean().backward()
        runs[-1][0].append(y.detach().clone())
        runs[-1][1].append({n: p.grad.clone() for n, p in model.named_parameters()})
    (outs_a, grads_a), (outs_b, grads_b) = runs
    assert all(bitwise_equal(a, b) for a, b in zip(outs_a, outs_b, strict=True))
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert all(bitwise_equal(ga[k], gb[k]) for k in gb)


def test_selective_checkpointing_sees_the_same_ops_in_both_runs():
    """Under SAC the recompute issues the weight's encode as the true forward did (SAC numbers
    the ops of both runs): with the quantize ops saved, it gets back the forward's codes."""
    for save_quantized in (False, True):
        state = f8s.Fp8State(f8s.QuantConfig(strict=False))
        model = state.convert(make_stack(n=2))
        ctx = f8s.selective_checkpoint_context(save_quantized=save_quantized)

        def run_block(block, x, ctx=ctx):
            return f8s.checkpoint(block, x, engine="torch", use_reentrant=False, context_fn=ctx)

        model.run_block = run_block
        with f8s.RecomputeAuditor(state) as auditor:
            run_events(state, model, event_inputs(3))
        assert auditor.report().ok, auditor.report().format_table()


def test_under_sac_a_weight_encoded_again_does_not_shift_sacs_numbering():
    """SAC hands a recompute's op the output its true forward's op of the same number stored.
    If the recompute reused some weights' codes and encoded one again (a weight edited in place
    in between), that one would be handed another layer's stored codes. Under SAC the recompute
    therefore encodes every weight, as the true forward did."""
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_stack(n=2))
    ctx = f8s.selective_checkpoint_context(save_quantized=True)
    model.run_block = lambda block, x: f8s.checkpoint(block, x, engine="torch", use_reentrant=False, context_fn=ctx)
    run_events(state, model, event_inputs(1))
    with state.step(1):
        y = model(event_inputs(1, seed=4)[0].requires_grad_(True))
        state.commit_forward()
        with torch.no_grad():
            model.blocks[0].fc2.weight.mul_(0.5)
        y.float().pow(2).mean().backward()  # fc2's stored codes come back as fc2's, not fc1's
    assert model.blocks[0].fc2.weight.grad.shape == model.blocks[0].fc2.weight.shape


def test_inference_encodes_the_weight_plainly():
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_stack(n=2))
    run_events(state, model, event_inputs(1))
    counter = _OpCounter()
    with counter, torch.no_grad():
        model(event_inputs(1, seed=3)[0])
    assert counter.counts["quantize_fp8_t_record_amax.default"] == 0
    assert counter.counts["quantize_fp8.default"] == 2 * 2 * 2  # input and weight of 4 linears


def test_weight_codes_once_must_be_a_bool_and_only_delayed_scaling_uses_it():
    with pytest.raises(f8s.ConfigError, match="weight_codes_once"):
        f8s.QuantConfig(weight_codes_once="yes")
    # a stateless recipe derives the weight's scale every call: it never keeps the codes
    current = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_current"))
    assert current.protocol.recipe.weight_codes_once is False


def test_a_layer_marked_sharded_holds_no_codes_and_trains_bitwise_the_same():
    """A weight that is partitioned between forward and recompute (FSDP2, DeepSpeed ZeRO-3) must
    not be held as codes per call (a full weight's bytes per layer on every rank): marked
    sharded, a call keeps none, its recompute encodes the weight again, bitwise the same run."""
    from lightning_fp8state.nn.fsdp import mark_sharded

    runs = {}
    for marked in (False, True):
        state = f8s.Fp8State(f8s.QuantConfig(strict=False))
        model = state.convert(make_stack(n=2, ckpt=("torch", False)))
        names = mark_sharded(model, every_layer=True) if marked else []
        assert mark_sharded(model) == []  # no FSDP2 unit: nothing is sharded
        assert sorted(state.protocol.sharded_layers) == names
        held = []
        with f8s.RecomputeAuditor(state) as auditor, state.step(0):
            y = model(event_inputs(1)[0])
            records = [r for rs in state.protocol.stash._by_layer.values() for r in rs]
            held.append(sum("weight_codes" in r.derived for r in records))
            state.commit_forward()
            y.float().pow(2).mean().backward()
        assert auditor.report().ok, auditor.report().format_table()
        outs, grads = run_events(state, model, event_inputs(3), step0=1)
        runs[marked] = (held, outs, grads, len(names))
    assert runs[False][0] == [4] and runs[True][0] == [0] and runs[True][3] == 4
    for a, b in zip(runs[False][1], runs[True][1], strict=True):
        assert bitwise_equal(a, b)
    for ga, gb in zip(runs[False][2], runs[True][2], strict=True):
        assert all(bitwise_equal(ga[k], gb[k]) for k in ga)
