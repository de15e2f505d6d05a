"""Compiled blocks: the protocol's entry points are graph breaks, the audit still holds.

``Fp8Linear.forward`` and the FP4 attention quantizer are ``torch.compiler.disable``d, so a
compiled block runs them eager between compiled regions. Forward and recompute must stay
bit-identical in safe mode, and the naive defect must still show.
"""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT, GPTConfig


def audit_compiled(mode: str, steps: int = 2):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = GPT(GPTConfig(d_model=32, n_heads=2, n_layers=2, seq_len=32, fp4_attention=True))
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    state.convert(model)
    for block in model.blocks:
        block.compile(backend="aot_eager")
    x = torch.randint(0, 64, (2, 32))
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(steps):
            with state.step(step):
                loss = model(x).float().pow(2).mean()
                state.commit_forward()
                loss.backward()
    return auditor.report(), state


@pytest.mark.parametrize("mode", ["safe", "naive"])
def test_compiled_blocks_keep_the_recompute_contract(mode):
    report, state = audit_compiled(mode)
    assert report.recomputed > 0  # the checkpointed calls were recomputed and compared
    if mode == "safe":
        assert report.ok and not report.mismatches
        assert not state.ledger.violations
    else:
        assert report.mismatches, "the naive defect must still show through compiled blocks"
