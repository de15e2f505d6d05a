"""A weight's codes once per event, on the GPU (tests/unit/test_weight_codes.py on the CPU): with
``torch._scaled_mm`` the backward transposes only the inputs' codes (the weight's come
transposed from the forward's one pass), the recompute encodes no weight, and the results stay
bitwise: checkpointed against un-checkpointed, eager against compiled."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal, make_stack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

D = 256
N_LINEARS = 8  # 4 blocks x 2


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[f"{func.namespace}::{func.__name__.removesuffix('.default')}"] += 1
        return func(*args, **(kwargs or {}))


def _inputs(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(64, D, device="cuda", generator=g, dtype=torch.bfloat16) * (1.5**i) for i in range(n)]


def _train(ckpt, xs, *, compiled=False, count_last=False):
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(make_stack(n=4, d=D, ckpt=ckpt)).cuda().bfloat16()
    run = torch.compile(model) if compiled else model
    outs, grads, counts = [], [], None
    with f8s.RecomputeAuditor(state) as auditor:
        for i, x in enumerate(xs):
            x = x.clone().requires_grad_(True)
            model.zero_grad(set_to_none=True)
            counter = _OpCounter() if count_last and i == len(xs) - 1 else None
            with state.step(i):
                if counter is not None:
                    counter.__enter__()
                y = run(x)
                state.commit_forward()
                y.float().pow(2).mean().backward()
                if counter is not None:
                    counter.__exit__(None, None, None)
                    counts = counter.counts
            outs.append(y.detach())
            grads.append([p.grad.detach().clone() for p in model.parameters()] + [x.grad.clone()])
    return auditor.report(), outs, grads, counts


def test_the_backward_transposes_only_the_inputs_and_the_recompute_encodes_no_weight():
    report, _, _, counts = _train(("torch", False), _inputs(3), count_last=True)
    assert report.ok, report.format_table()
    assert counts["fp8state::transpose_fp8"] == N_LINEARS, counts  # one per linear: its input's codes
    # the weights' codes with their transposes (forward) and grad_output's (backward), nothing in the recompute
    assert counts["fp8state::quantize_fp8_t_record_amax"] == 2 * N_LINEARS, counts
    assert counts["fp8state::quantize_fp8_record_amax"] == 2 * N_LINEARS, counts  # inputs: forward, recompute
    assert counts["aten::_scaled_mm"] == 4 * N_LINEARS, counts  # forward, recompute, two in the backward


@pytest.mark.parametrize("ckpt", [("torch", False), ("torch", True)], ids=["nonreentrant", "reentrant"])
def test_checkpointed_is_bitwise_the_uncheckpointed_run(ckpt):
    xs = _inputs(4)
    _, outs_ref, grads_ref, _ = _train(None, xs)
    report, outs, grads, _ = _train(ckpt, xs)
    assert report.ok and all(r.operands_equal for r in report.rows), report.format_table()
    for event in range(len(xs)):
        assert bitwise_equal(outs_ref[event], outs[event])
        for a, b in zip(grads_ref[event], grads[event], strict=True):
            assert bitwise_equal(a, b), f"event {event}"


def test_compiled_is_bitwise_eager_with_the_transposed_weight_codes():
    """torch.compile's op hands its backward the weight's transposed codes ([in, out]): the same
    bytes the eager call saves as a view."""
    xs = _inputs(3, seed=2)
    _, outs_ref, grads_ref, _ = _train(("torch", False), xs)
    _, outs, grads, _ = _train(("torch", False), xs, compiled=True)
    for event in range(len(xs)):
        assert bitwise_equal(outs_ref[event], outs[event])
        for a, b in zip(grads_ref[event], grads[event], strict=True):
            assert bitwise_equal(a, b), f"event {event}"
