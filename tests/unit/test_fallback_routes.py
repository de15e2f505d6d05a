"""QuantConfig.fallback moves the other linear-call modules too: GPT-2's Conv1D (Fp8Conv1D) and
nn.MultiheadAttention's projections (Fp8MultiheadAttention) run a moved layer's route.

The outlier (as in test_fallback_current.py): at step 3 one weight element becomes 1e37 and one
input feature is scaled by 1e8; delayed scaling keeps the 1e8 in its history, so from step 4 on the
layer's FP8 output overflows. Moved to bf16 (high precision) its output is the plain float GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal

OUTLIER_STEP, STEPS = 3, 6


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, 32, generator=g) for _ in range(STEPS)]


def _run(model: nn.Module, weight: torch.Tensor, to: str, forward, fallback: bool = True):
    state = f8s.Fp8State(f8s.QuantConfig(fallback=fallback, fallback_to=to))
    state.convert(model)
    gain = torch.ones(32)
    outs = []
    for step, x in enumerate(_batches()):
        with torch.no_grad():
            if step == OUTLIER_STEP:
                weight[0, 0] = 1e37
            gain[0] = 1e8 if step == OUTLIER_STEP else 1.0
        with state.step(step):
            y = forward(model, x * gain)
            y.float().sum().backward()
        model.zero_grad()
        outs.append((x * gain, y.detach()))
    return state, outs


def test_conv1d_moves_to_high_precision_and_runs_the_plain_gemm():
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415  (transformers: this test only)

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(32, 32))
    state, outs = _run(model, model[0].weight, "bf16", lambda m, x: m(x))
    assert "0" in state.protocol.fallen_back
    x, y = outs[-1]
    assert torch.isfinite(y).all()
    assert bitwise_equal(y, F.linear(x, model[0].weight.t(), model[0].bias))


def test_conv1d_moves_to_current_scaling():
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(32, 32))
    state, outs = _run(model, model[0].weight, "current", lambda m, x: m(x))
    assert "0" in state.protocol.fallen_back
    assert torch.isfinite(outs[-1][1]).all()


def test_attention_projection_moves():
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(32, 4, batch_first=True))

    def fwd(m, x):
        return m[0](x, x, x, need_weights=False)[0]

    state, outs = _run(model, model[0].in_proj_weight, "bf16", fwd)
    assert "0.in_proj" in state.protocol.fallen_back  # the packed in-projection, an Fp8Projection
    assert torch.isfinite(outs[-1][1]).all()


def _conv1d_steps(fallback: bool, checkpointed: bool):
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(32, 32))

    def fwd(m, x):
        if checkpointed:
            return f8s.checkpoint(m, x, engine="torch", use_reentrant=False)
        return m(x)

    state, outs = _run(model, model[0].weight, "current", fwd, fallback=fallback)
    return state, [y for _, y in outs]


def test_conv1d_fallback_faults_fewer_steps_and_checkpointing_is_bitwise_the_plain_run():
    _, off = _conv1d_steps(fallback=False, checkpointed=False)
    _, on = _conv1d_steps(fallback=True, checkpointed=False)
    state, ckpt = _conv1d_steps(fallback=True, checkpointed=True)
    faulty = [i for i, y in enumerate(on) if not torch.isfinite(y).all()]
    assert len(faulty) < sum(not torch.isfinite(y).all() for y in off)
    assert "0" in state.protocol.fallen_back
    for a, b in zip(on, ckpt, strict=True):
        assert bitwise_equal(a, b)
