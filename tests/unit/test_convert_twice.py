"""A model converted by one Fp8State cannot be converted by another (issue 41): the second
converted 0 layers silently, then failed later with a misleading message."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s


def test_a_second_fp8state_refuses_a_converted_model_and_the_first_may_convert_again():
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    first = f8s.Fp8State(f8s.QuantConfig())
    first.convert(model)
    with pytest.raises(f8s.AlreadyConvertedError, match=r"converted by another Fp8State \(layer '0'\)"):
        f8s.Fp8State(f8s.QuantConfig()).convert(model)
    first.convert(model)  # the same state again: a no-op, as before
    assert not first.last_conversion.converted
    with first.step(0, microbatch=0):
        model(torch.randn(4, 16)).sum().backward()


def test_a_multihead_attention_converted_by_another_fp8state_is_refused_by_name():
    """With its out_proj excluded, the first state's Fp8MultiheadAttention held the only quantizers:
    a second state left it alone, converted out_proj under itself (one module, two owners) and
    said nothing."""
    model = nn.Sequential(nn.MultiheadAttention(16, 2, batch_first=True))
    first = f8s.Fp8State(f8s.QuantConfig(exclude=("0.out_proj",)))
    first.convert(model)
    assert first.last_conversion.converted == ["0.in_proj"]
    second = f8s.Fp8State(f8s.QuantConfig())
    with pytest.raises(f8s.AlreadyConvertedError, match=r"^0 was converted by another Fp8State \(layer '0'\)"):
        second.convert(model)
    assert type(model[0].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear  # left as it was
