"""The ZeRO-2 accumulation window on the CPU: capture, a weights_only file round trip and
restore into a fresh optimizer, refusals of other layouts, and the reasons named for
configurations that are not supported. The optimizer is DeepSpeed's own class with the
attributes its epilogue leaves between microbatches (its __init__ needs GPUs); the end-to-end
check is tests/gpu/test_lightning_deepspeed.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from lightning_fp8state.errors import StateLoadError
from lightning_fp8state.lightning.deepspeed_accumulation import capture_window, restore_window, unsupported_reason
from tests.conftest import bitwise_equal

SHAPES = [(4, 3), (5,)]


def zero2(*, micro_steps: int = 6, gas: int = 4, stage: int = 2, seed: int | None = 0, **attrs):
    optimizer = object.__new__(DeepSpeedZeroOptimizer)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in SHAPES]
    g = torch.Generator().manual_seed(seed or 0)
    optimizer.__dict__.update(
        bit16_groups=[params],
        params_in_partition=[params],
        partition_size=[17],
        dtype=torch.bfloat16,
        gradient_accumulation_dtype=torch.bfloat16,
        cpu_offload=False,
        zenflow=False,
        partition_gradients=True,
        _coalesce_grad_reduction=False,
        averaged_gradients={},
        all_grad_tensors={} if seed is None else {0: [torch.randn(s, generator=g).bfloat16() for s in SHAPES]},
        micro_step_id=1,
    )
    optimizer.__dict__.update(attrs)
    return SimpleNamespace(
        optimizer=optimizer,
        micro_steps=micro_steps,
        gradient_accumulation_steps=lambda: gas,
        zero_optimization_stage=lambda: stage,
        managed_gradient_accumulation=lambda: True,
        _is_gradient_accumulation_boundary=None,
        pipeline_parallelism=False,
    )


def test_the_window_round_trips_through_a_weights_only_file(tmp_path):
    saved_engine = zero2()
    assert unsupported_reason(saved_engine) is None
    torch.save(capture_window(saved_engine, rank=0, world_size=1), tmp_path / "w.pt")
    fresh = zero2(micro_steps=0, seed=None)
    restore_window(fresh, torch.load(tmp_path / "w.pt", weights_only=True), 0, 1, torch.device("cpu"))
    assert fresh.micro_steps == 6 and fresh.optimizer.micro_step_id == 1
    for a, b in zip(saved_engine.optimizer.all_grad_tensors[0], fresh.optimizer.all_grad_tensors[0], strict=True):
        assert bitwise_equal(a, b)
    assert fresh.optimizer.averaged_gradients[0] is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rank": 1}, "rank expected 0"),
        ({"world_size": 2}, "world_size expected 1"),
        ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps expected 4"),
        ({"format_version": 99}, "format_version 99"),
    ],
)
def test_a_window_of_another_run_is_refused(change, match):
    saved = {**capture_window(zero2(), 0, 1), **change}
    fresh = zero2(micro_steps=0, seed=None)
    with pytest.raises(StateLoadError, match=match):
        restore_window(fresh, saved, 0, 1, torch.device("cpu"))
    assert fresh.micro_steps == 0 and fresh.optimizer.all_grad_tensors == {}


def test_a_window_of_another_model_is_refused():
    saved = capture_window(zero2(), 0, 1)
    other = zero2(micro_steps=0, seed=None, partition_size=[18])
    with pytest.raises(StateLoadError, match="layout expected"):
        restore_window(other, saved, 0, 1, torch.device("cpu"))


class Wrapper(DeepSpeedZeroOptimizer):
    pass


@pytest.mark.parametrize(
    ("engine", "match"),
    [
        (lambda: zero2(stage=3), "ZeRO stage 3"),
        (lambda: zero2(stage=1), "ZeRO stage 1"),
        (lambda: zero2(cpu_offload=True), "optimizer offload"),
        (lambda: zero2(zenflow=True), "ZenFlow"),
        (lambda: zero2(averaged_gradients={0: [torch.zeros(1)]}), "averaged_gradients of group 0"),
    ],
)
def test_unsupported_configurations_are_named(engine, match):
    assert match in unsupported_reason(engine())


def test_another_optimizer_class_is_named():
    engine = zero2()
    wrapped = object.__new__(Wrapper)
    wrapped.__dict__.update(engine.optimizer.__dict__)
    engine.optimizer = wrapped
    assert "the optimizer wrapper Wrapper" in unsupported_reason(engine)
    with pytest.raises(StateLoadError, match="this run uses the optimizer wrapper Wrapper"):
        restore_window(engine, capture_window(zero2(), 0, 1), 0, 1, torch.device("cpu"))
