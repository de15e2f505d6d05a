"""The pure per-step metric functions, the window recorder, token counting, JSONL encoding
and the engine reader, each against an independent computation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_fp8state.errors import ConfigError
from lightning_fp8state.telemetry import (
    StepRecorder,
    clip_event,
    count_tokens,
    gradient_norms,
    gradient_summary,
    loss_summary,
    read_engine_step,
    read_jsonl,
    source_groups,
)
from lightning_fp8state.telemetry.sinks import JsonlSink
from tests.telemetry.helpers import FakeDeepSpeedEngine


def test_gradient_norms_match_float64_norms_of_each_tensor():
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(5, 7, generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.randn(2, 2, 2, generator=g),
    ]
    norms = gradient_norms(grads)
    expected = [math.sqrt(sum(float(v) ** 2 for v in t.double().flatten())) for t in grads]
    assert norms.dtype == torch.float64
    assert norms.tolist() == pytest.approx(expected, rel=1e-12)
    inf_norms = gradient_norms(grads, math.inf)
    assert inf_norms.tolist() == pytest.approx([float(t.double().abs().max()) for t in grads])


@pytest.mark.parametrize(
    "bad, finite",
    [(float("nan"), 0.0), (float("inf"), 0.0), (-float("inf"), 0.0), (3e38, 1.0)],
    ids=["nan", "inf", "-inf", "huge-but-finite"],
)
def test_finiteness_is_exact_per_element(bad, finite):
    """Only a NaN/inf element makes a step non-finite: a float32 norm of 3e38-sized
    elements would overflow to inf, the float64 accumulation does not."""
    grads = [torch.ones(4, 4), torch.zeros(3)]
    grads[1][1] = bad
    norms = gradient_norms(grads)
    summary = gradient_summary(norms, torch.tensor([0, 1]), 2)
    assert float(summary["grad_finite"]) == finite
    if finite:  # the case a float32 norm gets wrong
        assert torch.linalg.vector_norm(grads[1]).isinf()


def test_dominant_source_and_shares():
    names = ["a.weight", "a.bias", "b.weight", "c.weight", "c.bias"]
    sources, index = source_groups(names, "layer")
    assert sources == ["a", "b", "c"] and index == [0, 0, 1, 2, 2]
    norms = torch.tensor([1.0, 2.0, 1.0, 3.0, 4.0], dtype=torch.float64)  # c: 9 + 16 = 25 of 31
    s = gradient_summary(norms, torch.tensor(index), len(sources))
    assert sources[int(s["dominant_index"])] == "c"
    assert float(s["dominant_share"]) == pytest.approx(25 / 31)
    assert float(s["grad_norm"]) == pytest.approx(math.sqrt(31))
    # a source holding a NaN is named: that is where the non-finite gradient came from
    s = gradient_summary(torch.tensor([1.0, 2.0, float("nan"), 3.0, 4.0], dtype=torch.float64), torch.tensor(index), 3)
    assert sources[int(s["dominant_index"])] == "b"
    by_param, _ = source_groups(names, "parameter")
    assert by_param == names
    with pytest.raises(ConfigError, match=r"by='.*' is not allowed: expected one of \['layer', 'parameter'\]"):
        source_groups(names, "module")


@pytest.mark.parametrize("scale", [0.1, 0.999, 1.0, 1.5, 40.0])
def test_clip_event_agrees_with_torch_clip_grad_norm(scale):
    """A clip event is counted exactly when torch's clip_grad_norm_ changes the gradients."""
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(6, 3)), torch.nn.Parameter(torch.zeros(4))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    threshold = total / scale
    before = [p.grad.clone() for p in params]
    torch.nn.utils.clip_grad_norm_(params, threshold)
    changed = any(not torch.equal(b, p.grad) for b, p in zip(before, params, strict=True))
    norm = gradient_norms(before).square().sum().sqrt()
    assert bool(clip_event(norm, None, threshold)) == changed


def test_clip_event_value_and_nonfinite():
    norm = torch.tensor(5.0, dtype=torch.float64)
    assert float(clip_event(norm, torch.tensor(2.0), 1.0, "value")) == 1.0
    assert float(clip_event(norm, torch.tensor(0.5), 1.0, "value")) == 0.0
    assert float(clip_event(torch.tensor(float("nan")), None, 1.0)) == 0.0  # skipped, not clipped
    with pytest.raises(ConfigError, match=r"algorithm='percentile' is not allowed: expected one of"):
        clip_event(norm, None, 1.0, "percentile")


def test_loss_summary():
    s = loss_summary(torch.tensor(2.5, dtype=torch.bfloat16))
    assert float(s["loss"]) == 2.5 and float(s["loss_finite"]) == 1.0
    assert float(loss_summary(torch.tensor(float("inf")))["loss_finite"]) == 0.0


def test_recorder_returns_every_step_in_order():
    rec = StepRecorder()
    rec.append({"a": torch.tensor(1.5), "b": torch.tensor(True)}, {"step": 1, "name": "x"})
    rec.append({}, {"step": 2})
    rec.append({"a": torch.tensor(float("nan"), dtype=torch.bfloat16)}, {"step": 3})
    rows = rec.drain()
    assert len(rec) == 0
    assert rows[0] == {"step": 1, "name": "x", "a": 1.5, "b": 1.0}
    assert rows[1] == {"step": 2}
    assert rows[2]["step"] == 3 and math.isnan(rows[2]["a"])
    assert rec.drain() == []


def test_count_tokens():
    ids = torch.zeros(4, 128, dtype=torch.long)
    assert count_tokens(ids) == 512
    assert count_tokens((ids, ids)) == 512
    assert count_tokens({"input_ids": ids}) == 512
    assert count_tokens([torch.randn(8, 16), torch.randn(8, 1)]) == 8  # features: samples
    assert count_tokens(["text", None]) == 0


def test_jsonl_is_strict_json_and_round_trips_nonfinite(tmp_path):
    sink = JsonlSink(tmp_path / "run" / "t.jsonl")
    assert not (tmp_path / "run").exists()  # nothing is created before the first write
    sink.write([{"step": 1, "loss": float("nan"), "norm": float("inf"), "low": -float("inf"), "name": "a"}])
    sink.write([{"step": 2, "loss": 0.5}])
    sink.close()
    lines = (tmp_path / "run" / "t.jsonl").read_text().splitlines()

    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    assert [json.loads(line, parse_constant=reject)["step"] for line in lines] == [1, 2]
    rows = read_jsonl(tmp_path / "run" / "t.jsonl")
    assert math.isnan(rows[0]["loss"]) and rows[0]["norm"] == math.inf and rows[0]["low"] == -math.inf
    assert rows[0]["name"] == "a" and rows[1] == {"step": 2, "loss": 0.5}


def test_read_engine_step_reads_a_deepspeed_like_engine():
    engine = FakeDeepSpeedEngine()
    engine.step(overflow=True, norm=torch.tensor(3.0))
    info = read_engine_step(engine)
    assert info.skipped_steps == 1 and info.loss_scale == 32768.0 and info.overflow is True
    assert isinstance(info.grad_norm, torch.Tensor) and float(info.grad_norm) == 3.0
    assert read_engine_step(torch.nn.Linear(2, 2)) is None
    assert read_engine_step(None) is None

    class Bare:  # an engine exposing the counter only
        skipped_steps = 4

    info = read_engine_step(Bare())
    assert (info.skipped_steps, info.loss_scale, info.overflow, info.grad_norm) == (4, None, None, None)
