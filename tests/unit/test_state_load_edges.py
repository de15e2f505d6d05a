"""A saved quantizer state loads back into the model it came from, whatever ran before the save
(issue 43, edges 2 and 3): a model with ``nn.MultiheadAttention`` (whose packed in-projection
is converted as five owner names, of which self-attention uses one), and a model with a layer
that had not run yet (a head used only some steps). A model with more converted layers than the
saved one is still refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import StateLoadError


class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.attn(x, x, x, need_weights=False)[0])


class WithAuxHead(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(16, 16)
        self.aux = nn.Linear(16, 4)  # used on even steps only
        self.extra = nn.Linear(16, 16) if extra else None

    def forward(self, x, step: int):
        h = self.body(x)
        return self.aux(h).sum() if step % 2 == 0 else h.sum()


def _train(state, model, steps, call):
    for step in steps:
        with state.step(step):
            call(model, step).backward()


@pytest.mark.parametrize("order", ["convert-then-load", "load-then-convert"])
def test_a_model_with_multihead_attention_loads_its_saved_state(order):
    src = f8s.Fp8State()
    model = src.convert(WithAttention())
    _train(src, model, range(2), lambda m, s: m(torch.randn(2, 5, 16)).pow(2).mean())
    saved = src.state_dict()
    dst = f8s.Fp8State()
    if order == "convert-then-load":
        dst.convert(WithAttention())
        dst.load_state_dict(saved)
    else:
        dst.load_state_dict(saved)
        dst.convert(WithAttention())
    assert dst.state_dict()["bank"]["owners"] == saved["bank"]["owners"]


def test_a_layer_that_had_not_run_by_the_save_does_not_block_the_load():
    src = f8s.Fp8State()
    model = src.convert(WithAuxHead())
    _train(src, model, [1], lambda m, s: m(torch.randn(4, 16), s))  # odd step: aux does not run
    saved = src.state_dict()
    assert "aux" in saved["converted_layers"]
    dst = f8s.Fp8State()
    resumed = dst.convert(WithAuxHead())
    dst.load_state_dict(saved)
    _train(dst, resumed, [2, 3], lambda m, s: m(torch.randn(4, 16), s))  # and it trains on, aux included


def test_a_model_with_more_converted_layers_is_still_refused():
    src = f8s.Fp8State()
    model = src.convert(WithAuxHead())
    _train(src, model, [0], lambda m, s: m(torch.randn(4, 16), s))
    dst = f8s.Fp8State()
    dst.convert(WithAuxHead(extra=True))
    with pytest.raises(StateLoadError, match="extra"):
        dst.load_state_dict(src.state_dict())
