"""A converted Linear's output may be modified in place, as ``nn.Linear``'s may: an in-place
ReLU, ``out += residual`` and Falcon's in-place GELU run, bitwise their out-of-place forms, with
recompute audited (issue 43, edge 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal


class Mlp(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.inplace = inplace

    def forward(self, x):
        h = self.up(x)
        if self.inplace:
            torch.relu_(h)
            out = self.down(h)
            out += x  # the residual added into the converted output
            out.mul_(0.5)
            return out
        return (self.down(torch.relu(h)) + x) * 0.5


class Net(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Mlp(inplace) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = f8s.checkpoint(block, x, engine="torch", use_reentrant=False)
        return x


def _run(inplace: bool, recipe: str):
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe))
    model = state.convert(Net(inplace))
    outs, grads = [], []
    g = torch.Generator().manual_seed(1)
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(3):
            x = (torch.randn(3, 5, 16, generator=g) * (1 + step)).requires_grad_(True)
            with state.step(step):
                y = model(x)
                y.pow(2).mean().backward()
            outs.append(y.detach().clone())
            grads.append([x.grad.clone(), *(p.grad.clone() for p in model.parameters())])
            model.zero_grad(set_to_none=True)
    return outs, grads, auditor.report()


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current", "fp8_rowwise"])
def test_in_place_ops_on_a_converted_output_run_bitwise_their_out_of_place_form(recipe):
    ref_outs, ref_grads, _ = _run(False, recipe)
    outs, grads, report = _run(True, recipe)
    assert report.ok, report.format_table()
    for a, b in zip(ref_outs, outs, strict=True):
        assert bitwise_equal(a, b)
    for ga, gb in zip(ref_grads, grads, strict=True):
        assert all(bitwise_equal(u, v) for u, v in zip(ga, gb, strict=True))


def test_a_3d_input_in_place_add_outside_any_checkpoint():
    state = f8s.Fp8State()
    layer = state.convert(nn.Sequential(nn.Linear(8, 8)))[0]
    x = torch.randn(2, 3, 8, requires_grad=True)
    with state.step(0):
        y = layer(x)
        y += 1.0  # nn.Linear allows it; the gradients are those of y + 1
        y.sum().backward()
    assert torch.equal(layer.bias.grad, torch.full((8,), 6.0))
