"""Quantizer health in telemetry: saturated fractions against an independent count, commits
per event, ledger violations and recompute mismatches (safe vs the naive defect)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.telemetry import TrainingTelemetry, owner_label, read_jsonl
from lightning_fp8state.telemetry.quantizer import quantizer_health
from tests.conftest import event_inputs, make_stack

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


class Checkpointed(nn.Module):
    def __init__(self, inner, ckpt):
        super().__init__()
        self.inner, self.ckpt = inner, ckpt

    def forward(self, x):
        if self.ckpt is None:
            return self.inner(x)
        return f8s.checkpoint(self.inner, x, engine="torch", use_reentrant=self.ckpt)


@pytest.mark.parametrize("ckpt", [None, False, True], ids=["no-ckpt", "nonreentrant", "reentrant"])
def test_saturated_fraction_matches_an_independent_count(tmp_path, ckpt):
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig())
    lin = nn.Sequential(nn.Linear(32, 16, bias=False))
    model = Checkpointed(state.convert(lin), ckpt)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    tel = TrainingTelemetry(tmp_path, model=model, state=state, log_every=1)
    g = torch.Generator().manual_seed(3)
    expected = {}
    for step in range(4):
        x = torch.randn(8, 32, generator=g)
        grad_y = torch.randn(8, 16, generator=g) * 1e-3
        if step == 3:  # outliers far above what the delayed scales were derived from
            x[0, :5] *= 50.0
            grad_y[1, :3] *= 1e4
            owners = {o.role: o for o in state.bank.owners}
            scales = {role: state.scale_of(o).clone() for role, o in owners.items()}
            w = lin[0].weight.detach()
            expected = {
                owners["input"]: (int(((x * scales["input"]).abs() > E4M3_MAX).sum()), x.numel()),
                owners["weight"]: (int(((w * scales["weight"]).abs() > E4M3_MAX).sum()), w.numel()),
                owners["grad_output"]: (int(((grad_y * scales["grad_output"]).abs() > E5M2_MAX).sum()), grad_y.numel()),
            }
        with state.step(step):
            y = model(x.requires_grad_(True))
            (y * grad_y).sum().backward()  # the gradient arriving at y is exactly grad_y
        tel.before_optimizer_step(opt)
        tel.after_optimizer_step()
    tel.close()
    assert expected[owners["input"]][0] >= 5 and expected[owners["grad_output"]][0] >= 3  # the test bites
    last = read_jsonl(tmp_path / "telemetry.jsonl")[-1]
    for owner, (hits, elements) in expected.items():
        assert last[f"fp8state/saturated_frac/{owner_label(owner)}"] == pytest.approx(hits / elements), owner
    total_hits = sum(h for h, _ in expected.values())
    assert last["fp8state/saturated_frac"] == pytest.approx(total_hits / sum(n for _, n in expected.values()))
    assert state.protocol.auditors == []  # nothing attached to count saturation


def run_audited(tmp_path, mode):
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    model = state.convert(make_stack(n=2, ckpt=("torch", False)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with f8s.RecomputeAuditor(state):
        tel = TrainingTelemetry(tmp_path, model=model, state=state, log_every=2)
        for step, x in enumerate(event_inputs(4)):
            with state.step(step):
                loss = model(x.requires_grad_(True)).float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            tel.before_optimizer_step(opt, loss=loss)
            opt.step()
            opt.zero_grad()
            tel.after_optimizer_step()
        tel.close()
    return state, [r for r in read_jsonl(tmp_path / "telemetry.jsonl") if "fp8state/owners" in r]


def test_safe_mode_health_one_commit_no_violation_no_mismatch(tmp_path):
    state, logs = run_audited(tmp_path, "safe")
    assert [r["step"] for r in logs] == [2, 4]
    for r in logs:
        assert r["fp8state/owners"] == len(state.bank) == 2 * 2 * 3
        assert r["fp8state/commits_per_event_min"] == r["fp8state/commits_per_event_max"] == 1.0
        assert r["fp8state/ledger_violations"] == 0.0
        assert r["fp8state/recompute_mismatches"] == 0.0
        assert r["fp8state/recomputed_calls"] > 0
    for owner in state.bank.owners:  # the last row holds the live state at the end
        assert logs[-1][f"fp8state/scale/{owner_label(owner)}"] == float(state.scale_of(owner))
        assert logs[-1][f"fp8state/amax/{owner_label(owner)}"] == float(
            state.bank.amax_history[0, state.bank.index[owner]]
        )


def test_naive_mode_health_shows_double_commits_violations_mismatches(tmp_path):
    state, logs = run_audited(tmp_path, "naive")
    last = logs[-1]
    assert last["fp8state/commits_per_event_max"] >= 2.0  # recompute committed again
    assert last["fp8state/ledger_violations"] == len(state.ledger.violations) > 0
    assert last["fp8state/recompute_mismatches"] > 0


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_rowwise", "fp8_blockwise"])
def test_a_stateless_recipe_counts_its_owners_like_delayed_scaling(recipe):
    """Per-call recipes hold no bank, but each layer still has its input, weight and grad_output
    owners: ``fp8state/owners`` (the report's "quantizer owners") counts them as it counts
    fp8_delayed's, not 0."""
    counts = {}
    for name in (recipe, "fp8_delayed"):
        state = f8s.Fp8State(f8s.QuantConfig(recipe=name, strict=False))
        model = state.convert(make_stack(n=2))
        with state.step(0):
            model(torch.randn(4, 16, requires_grad=True)).pow(2).mean().backward()
        counts[name] = quantizer_health(state)[0]["fp8state/owners"]
    linears = 2 * 2
    assert counts[recipe] == counts["fp8_delayed"] == 3 * linears


def test_bf16_control_reports_no_owners(tmp_path):
    state = f8s.Fp8State(f8s.QuantConfig(recipe="bf16"))
    model = state.convert(make_stack(n=1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tel = TrainingTelemetry(tmp_path, model=model, state=state, log_every=1)
    assert tel.saturation is None
    with state.step(0):
        model(torch.randn(4, 16)).pow(2).mean().backward()
    tel.before_optimizer_step(opt)
    row = tel.after_optimizer_step()
    tel.close()
    assert row["fp8state/owners"] == 0.0 and row["fp8state/ledger_violations"] == 0.0
    assert not any(k.startswith("fp8state/scale") for k in row)
