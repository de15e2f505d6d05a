"""Selective activation checkpointing on the GPU: the CUDA kernels and torch._scaled_mm under
SAC policies (save matmuls, save nothing, save our FP8 codes), checkpointed gradients bitwise
equal to uncheckpointed ones, the audit clean, the naive mode different."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT, GPTConfig
from tests.conftest import bitwise_equal, make_stack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

D = 256
N_EVENTS = 6
aten = torch.ops.aten


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (aten.mm.default, aten._scaled_mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "save_matmuls": lambda: functools.partial(create_selective_checkpoint_contexts, _save_matmuls),
    "save_nothing": lambda: f8s.selective_checkpoint_context(()),
    "save_quantized": lambda: f8s.selective_checkpoint_context(save_quantized=True),
}


def run(mode, path, policy):
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    model = state.convert(make_stack(n=4, d=D, gains=[1.0, 8.0, 0.25, 2.0])).cuda().bfloat16()
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(64, D, device="cuda", generator=g, dtype=torch.bfloat16) * (1.5**i) for i in range(N_EVENTS)]
    grads = []
    with f8s.RecomputeAuditor(state) as auditor:
        for i, x in enumerate(xs):
            x = x.clone().requires_grad_(True)
            model.zero_grad(set_to_none=True)
            with state.step(i):
                y = x
                for block in model.blocks:
                    if path is None:
                        y = block(y)
                    elif path == "plain":
                        y = torch_checkpoint(block, y, use_reentrant=False, context_fn=POLICIES[policy]())
                    else:
                        y = f8s.checkpoint(block, y, context_fn=POLICIES[policy]())
                loss = y.float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            grads.append([p.grad.detach().clone() for p in model.parameters()] + [x.grad.clone()])
    return state, auditor.report(), grads


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("path", ["plain", "wrapper"])
def test_sac_on_cuda_bitwise(path, policy):
    assert f8s.ops.cuda.ensure_loaded(), f8s.ops.cuda.extension_info()
    _, _, ref = run("safe", None, None)
    state, report, got = run("safe", path, policy)
    assert report.recomputed > 0 and report.ok, report.format_table()
    for e, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert all(bitwise_equal(u, v) for u, v in zip(a, b, strict=True)), f"event {e}"
    assert state.ledger.ok


def test_sac_scaled_mm_is_what_is_saved(monkeypatch):
    """The GPU path's GEMM is aten._scaled_mm: the save-matmuls policy keeps it."""
    seen = []

    def spy(ctx, op, *args, **kwargs):
        seen.append(op)
        return _save_matmuls(ctx, op, *args, **kwargs)

    POLICIES["spy"] = lambda: functools.partial(create_selective_checkpoint_contexts, spy)
    try:
        run("safe", "wrapper", "spy")
    finally:
        del POLICIES["spy"]
    assert aten._scaled_mm.default in seen
    assert torch.ops.fp8state.quantize_fp8_record_amax.default in seen


def test_sac_naive_on_cuda_differs():
    _, _, ref = run("naive", None, None)
    _, report, got = run("naive", "wrapper", "save_matmuls")
    assert not report.ok
    assert any(not bitwise_equal(u, v) for a, b in zip(ref, got, strict=True) for u, v in zip(a, b, strict=True))


def test_sac_gpt_fused_prologues_on_cuda_bitwise():
    def go(ckpt):
        state = f8s.Fp8State(f8s.QuantConfig())
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(vocab_size=256, seq_len=64, d_model=256, n_layers=2, n_heads=4, checkpoint=False))
        state.convert(gpt)
        gpt = gpt.cuda()
        if ckpt:
            ctx = f8s.selective_checkpoint_context(save_quantized=True)
            for block in gpt.blocks:
                inner = block.forward
                block.forward = lambda x, inner=inner: f8s.checkpoint(inner, x, context_fn=ctx)
        g = torch.Generator(device="cuda").manual_seed(1)
        grads = []
        with f8s.RecomputeAuditor(state) as auditor:
            for step in range(4):
                idx = torch.randint(0, 256, (4, 64), device="cuda", generator=g)
                gpt.zero_grad(set_to_none=True)
                with state.step(step), torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = gpt.loss(idx, torch.roll(idx, 1, 1))
                    state.commit_forward()
                    loss.backward()
                grads.append([p.grad.clone() for p in gpt.parameters() if p.grad is not None])
        return auditor.report(), grads

    _, ref = go(False)
    report, got = go(True)
    assert report.recomputed > 0 and report.ok, report.format_table()
    for a, b in zip(ref, got, strict=True):
        assert all(bitwise_equal(u, v) for u, v in zip(a, b, strict=True))
