"""lightning.deepspeed_guard: DeepSpeed ZeRO-1/2's bf16 non-finite check and clipping on the
device, checked against a DeepSpeed-shaped optimizer on the CPU (the real engine runs in
tests/gpu/test_lightning_deepspeed.py).

A clipped step must be bitwise DeepSpeed's arithmetic followed by the same fused AdamW step; a
non-finite step must leave the parameters, the moments and the step count bitwise untouched;
the telemetry counts the skipped step from the flag, read with the window.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_fp8state.lightning import deepspeed_guard
from lightning_fp8state.telemetry import TrainingTelemetry
from lightning_fp8state.telemetry.engines import FOUND_INF_ATTR, read_engine_step

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "_fused_adamw_"), reason="needs torch's fused AdamW kernel on the CPU"
)


class DeepSpeedZeroOptimizer:  # the name the guard checks, with the attributes it reads
    def __init__(self, clip: float):
        self.check_grad_overflow = True
        self.clip_grad = clip
        self._global_grad_norm = None
        self.compute_grad_norm = True
        self.loss_scale = 1.0
        self.dtype = torch.bfloat16
        self.cpu_offload = False
        self.torch_autocast_gradscaler = None


def engine_for(param, *, clip=1.0, fused=True):
    basic = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1, fused=fused)
    return SimpleNamespace(optimizer=DeepSpeedZeroOptimizer(clip), basic_optimizer=basic, skipped_steps=0)


def ds_step(engine, grad):
    """What DeepSpeed's step does around the basic optimizer, its own check and clip now off:
    the norm on the device, then optimizer.step()."""
    p = engine.basic_optimizer.param_groups[0]["params"][0]
    p.grad = grad.clone()
    engine.optimizer._global_grad_norm = torch.linalg.vector_norm(grad.float())
    engine.basic_optimizer.step()


def fresh(seed, n=1000):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 3


def test_a_finite_step_is_deepspeeds_clip_then_the_fused_step_bitwise():
    p = torch.nn.Parameter(fresh(0))
    engine = engine_for(p)
    assert deepspeed_guard.install(engine) is None
    assert engine.optimizer.clip_grad == 0.0 and engine.optimizer.check_grad_overflow is False
    ref = torch.nn.Parameter(p.detach().clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        grad = fresh(10 + step) * (10 if step == 1 else 0.01)  # clipped at step 1 only
        ds_step(engine, grad)
        # DeepSpeed's unscale_and_clip_grads, by hand
        norm = torch.linalg.vector_norm(grad.float())
        combined = torch.clamp(((norm / 1.0) + 1e-6) / 1.0, min=1.0) * 1.0
        ref.grad = grad.clone()
        ref.grad.mul_(1.0 / combined)
        ref_opt.step()
        assert torch.equal(p, ref)
        assert getattr(engine, FOUND_INF_ATTR).item() == 0.0
    assert not hasattr(engine.basic_optimizer, "found_inf")  # this step's flag only


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_step_is_skipped_on_the_device(bad):
    p = torch.nn.Parameter(fresh(1))
    engine = engine_for(p)
    deepspeed_guard.install(engine)
    ds_step(engine, fresh(2))
    before = p.detach().clone()
    state = {k: v.clone() for k, v in engine.basic_optimizer.state[p].items()}
    grad = fresh(3)
    grad[17] = bad
    ds_step(engine, grad)
    assert torch.equal(p, before)
    for k, v in engine.basic_optimizer.state[p].items():
        assert torch.equal(v, state[k]), k  # moments and the step count untouched
    assert getattr(engine, FOUND_INF_ATTR).item() == 1.0
    ds_step(engine, fresh(4))  # and the next finite step applies
    assert not torch.equal(p, before)


def test_the_telemetry_counts_the_device_guards_skips(tmp_path):
    model = torch.nn.Linear(4, 4)
    p = torch.nn.Parameter(fresh(5))
    engine = engine_for(p)
    deepspeed_guard.install(engine)
    tel = TrainingTelemetry(tmp_path, model=model, log_every=4, guard=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(4):
        model(torch.randn(2, 4)).sum().backward()
        tel.before_optimizer_step(opt, loss=torch.tensor(1.0), tokens=8)
        grad = fresh(20 + step)
        if step == 2:
            grad[0] = float("nan")
        ds_step(engine, grad)
        info = read_engine_step(engine)
        assert info is not None and info.found_inf is not None
        tel.after_optimizer_step(engine=engine)
        assert getattr(engine, FOUND_INF_ATTR) is None  # read once, for its own step
    tel.close()
    assert (tel.attempted, tel.applied, tel.skipped) == (4, 3, 1)


def test_unsupported_engines_keep_deepspeeds_check_and_say_why():
    p = torch.nn.Parameter(fresh(6))
    engine = engine_for(p, fused=False)
    reason = deepspeed_guard.install(engine)
    assert "fused=True" in reason
    assert engine.optimizer.check_grad_overflow is True and engine.optimizer.clip_grad == 1.0
    engine = engine_for(p)
    engine.optimizer.dtype = torch.float16
    assert "fp16" in deepspeed_guard.install(engine)
    engine = engine_for(p)
    engine.optimizer.cpu_offload = True
    assert "offload" in deepspeed_guard.install(engine)
    other = SimpleNamespace(optimizer=object(), basic_optimizer=None)
    assert "ZeRO-1/2" in deepspeed_guard.install(other)
