"""Recompute under CUDA bf16 autocast on the GPU: every engine re-runs a region under its true
forward's autocast state, bitwise, with the CUDA kernels and torch._scaled_mm; naive caught."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.conftest import ENGINE_IDS, ENGINES, bitwise_equal, make_stack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

D = 256
N_EVENTS = 4


def run(mode, ckpt, recipe="fp8_delayed"):
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, recipe=recipe, strict=False))
    model = state.convert(make_stack(n=4, d=D, ckpt=ckpt)).cuda()  # float32 weights, bf16 autocast
    g = torch.Generator(device="cuda").manual_seed(0)
    outs, grads = [], []
    with f8s.RecomputeAuditor(state) as auditor:
        for i in range(N_EVENTS):
            x = (torch.randn(64, D, device="cuda", generator=g) * (1.5**i)).requires_grad_(True)
            model.zero_grad(set_to_none=True)
            with state.step(i):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = torch.nn.functional.layer_norm(model(x), (D,))  # float32 under autocast
                loss = y.float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            outs.append(y.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()} | {"x": x.grad.clone()})
    return auditor.report(), outs, grads


@pytest.mark.parametrize("recipe", ["fp8_delayed", "bf16"])
@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_cuda_autocast_recompute_is_the_true_forward_bitwise(ckpt, recipe):
    report, outs_ck, grads_ck = run("safe", ckpt, recipe)
    assert report.recomputed >= 4 * N_EVENTS
    assert report.ok, report.format_table()
    _, outs_ref, grads_ref = run("safe", None, recipe)
    for event in range(N_EVENTS):
        assert bitwise_equal(outs_ref[event], outs_ck[event]), f"event {event}: output differs"
        for name, grad in grads_ref[event].items():
            assert bitwise_equal(grad, grads_ck[event][name]), f"event {event}: grad of {name} differs"


@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_cuda_autocast_naive_is_caught(ckpt):
    report, _, _ = run("naive", ckpt)
    assert not report.ok
    assert {"record_in_recompute", "second_commit"} <= {v.kind for v in report.violations}
