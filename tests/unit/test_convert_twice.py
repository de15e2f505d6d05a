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
