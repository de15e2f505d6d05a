"""Shared loop for the model-library tests: a few optimizer steps of a tiny model, one logical
event each, gradients kept bitwise for comparison between checkpointed and plain runs."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal

STEPS = 4
SEQ = 16
VOCAB = 128


def batches(n: int = STEPS, batch: int = 2, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(n)]


def train(state, model, loss_fn, data, *, audit: bool = True, lr: float = 1e-2):
    """``len(data)`` steps of AdamW (so weights, hence amaxes and scales, move every step):
    each step one event ``(step, 0)``; returns per-step gradients (name -> tensor) and the
    audit report (recorded with the model, so module state changed by recompute shows)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    grads = []
    auditor = f8s.RecomputeAuditor(state, model=model) if audit else None
    if auditor is not None:
        auditor.__enter__()
    try:
        for step, tokens in enumerate(data):
            opt.zero_grad(set_to_none=True)
            with state.step(step):
                loss = loss_fn(model, tokens)
                state.commit_forward()
                loss.backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
    finally:
        if auditor is not None:
            auditor.__exit__(None, None, None)
    return grads, None if auditor is None else auditor.report()


def differing(ref: list[dict], got: list[dict]) -> list[tuple[int, str]]:
    """(step, parameter) pairs whose gradients are not bitwise equal (missing ones count)."""
    assert len(ref) == len(got)
    out = []
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        for name in a.keys() | b.keys():
            if name not in a or name not in b or not bitwise_equal(a[name], b[name]):
                out.append((step, name))
    return sorted(out)


def assert_bitwise(ref: list[dict], got: list[dict]) -> None:
    bad = differing(ref, got)
    assert not bad, f"{len(bad)} gradient(s) differ, first: {bad[:5]}"
    assert all(len(g) > 0 for g in got)


def assert_audit_complete(report, *, min_recomputed: int) -> None:
    """Every recomputed call compared (outputs, or operands for early-stopped ones) and equal."""
    assert report.ok, report.format_table()
    assert report.recomputed >= min_recomputed, report.format_table()


def converted_all(state, expected_min: int) -> None:
    report = state.last_conversion
    assert len(report.converted) >= expected_min, str(report)


def need(module: str):
    """Import a model library the integration extra installs; CI installs it, so a missing one
    is reported as a skip with the install command, never silently passed."""
    return pytest.importorskip(module, reason=f"needs {module}: pip install -e '.[integration]'")
