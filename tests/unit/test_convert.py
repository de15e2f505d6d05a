"""convert: every candidate reported (converted / skipped / not quantizable, with reasons), a
transformers-style Conv1D quantized for real, nn.MultiheadAttention's projections converted
(tests/unit/test_transformer_modules.py has the rest),
and the after-first-event check for converted layers that never ran through the protocol.

The real transformers Conv1D (GPT-2) is in tests/integration/test_hf.py; here a stand-in with
the same class name, module and layout keeps these tests free of transformers.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.nn import Fp8Conv1D
from tests.conftest import bitwise_equal


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D, verbatim (weight [nx, nf])."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"


class GPT2Mlp(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * d, d), Conv1D(d, 4 * d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


def events(state, model, n=3, d=32, seed=0, step0=0):
    g = torch.Generator().manual_seed(seed)
    grads = []
    for step in range(step0, step0 + n):
        x = torch.randn(4, 8, d, generator=g) * (2.0 ** (step - step0))
        model.zero_grad(set_to_none=True)
        with state.step(step):
            out = model(x)
            out = out[0] if isinstance(out, tuple) else out
            out.float().pow(2).mean().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    return grads


def test_conv1d_is_converted_and_quantized_for_real():
    torch.manual_seed(0)
    model = GPT2Mlp()
    reference = GPT2Mlp()
    reference.load_state_dict(model.state_dict())
    state = f8s.Fp8State(f8s.QuantConfig())
    params = [id(p) for p in model.parameters()]
    state.convert(model)
    report = state.last_conversion
    assert report.converted == ["c_fc", "c_proj"]
    assert "transformers Conv1D -> Fp8Conv1D" in report.how["c_fc"]
    assert isinstance(model.c_fc, Fp8Conv1D) and tuple(model.c_fc.weight.shape) == (32, 128)
    assert [id(p) for p in model.parameters()] == params  # shared, not copied
    assert list(model.state_dict()) == list(reference.state_dict())  # same keys: HF checkpoints load
    events(state, model)
    # quantized for real: every converted layer owns input/weight/grad_output state
    owners = {(o.layer, o.role) for o in state.bank.owners}
    for layer in ("c_fc", "c_proj"):
        assert {(layer, r) for r in ("input", "weight", "grad_output")} <= owners
    # ... and its output is FP8 arithmetic: close to the float32 Conv1D, not equal to it
    x = torch.randn(4, 8, 32)
    with torch.no_grad():
        got, want = model(x), reference(x)
    assert not torch.equal(got, want)
    assert ((got - want).norm() / want.norm()).item() < 0.1  # two FP8 layers: a few percent


def test_conv1d_equals_fp8linear_on_the_transposed_weight_bitwise():
    """The transposed weight is handled: Fp8Conv1D(W) is bitwise an Fp8Linear with weight W.t(),
    outputs and gradients (the gradient of W is the transpose of the Linear's)."""
    torch.manual_seed(1)
    conv = nn.Sequential(Conv1D(48, 32))
    lin = nn.Sequential(nn.Linear(32, 48))
    with torch.no_grad():
        lin[0].weight.copy_(conv[0].weight.t())
        lin[0].bias.copy_(conv[0].bias + 0.1)
        conv[0].bias.copy_(lin[0].bias)
    runs = []
    for model in (conv, lin):
        state = f8s.Fp8State(f8s.QuantConfig())
        state.convert(model)
        runs.append(events(state, model, n=4))
    for g_conv, g_lin in zip(*runs, strict=True):
        assert bitwise_equal(g_conv["0.weight"].t().contiguous(), g_lin["0.weight"])
        assert bitwise_equal(g_conv["0.bias"], g_lin["0.bias"])


def test_conv1d_checkpointed_gradients_equal_uncheckpointed_bitwise():
    def go(ckpt):
        torch.manual_seed(2)
        model = GPT2Mlp()
        state = f8s.Fp8State(f8s.QuantConfig())
        state.convert(model)
        if ckpt:
            inner = model.forward
            model.forward = lambda x: f8s.checkpoint(inner, x)
        return events(state, model, n=4)

    for a, b in zip(go(False), go(True), strict=True):
        assert all(bitwise_equal(a[k], b[k]) for k in a)


def test_conv1d_compiled_is_one_graph_and_bitwise_the_eager_run():
    """Under torch.compile the converted Conv1D is Fp8Linear's op on the weight view: no graph
    break (fullgraph), gradients bitwise the eager ones, checkpointed."""

    def go(compiled):
        torch.manual_seed(2)
        model = GPT2Mlp()
        state = f8s.Fp8State(f8s.QuantConfig())
        state.convert(model)
        inner = torch.compile(model.forward, backend="aot_eager", fullgraph=True) if compiled else model.forward
        model.forward = lambda x: f8s.checkpoint(inner, x)
        return events(state, model, n=3)

    torch._dynamo.reset()
    for a, b in zip(go(False), go(True), strict=True):
        assert a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


def test_multihead_attention_projections_are_converted_and_really_quantize():
    """nn.MultiheadAttention's out_proj (read by F.multi_head_attention_forward, its forward never
    ran) and its in-projection (a bare parameter, never in the report) are converted through
    Fp8MultiheadAttention since issue 27 (before it: out_proj "not quantizable", in_proj_weight
    absent); every converted layer really quantizes (owns state after an event). Before issue 17
    out_proj was reported converted while it never quantized."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.Sequential(layer)
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(model)
    report = state.last_conversion
    assert sorted(report.converted) == ["0.linear1", "0.linear2", "0.self_attn.in_proj", "0.self_attn.out_proj"]
    assert report.not_quantizable == {}
    assert isinstance(layer.self_attn.out_proj, f8s.Fp8Linear)
    with warnings.catch_warnings():
        warnings.simplefilter("error", f8s.ConversionWarning)
        events(state, model, n=2)
    layers_with_state = {o.layer for o in state.bank.owners}
    assert set(report.converted) <= layers_with_state


class _ReadsWeightOutside(nn.Module):
    """A parent that uses its child's weight directly: the child's forward never runs. It reads
    it in a method its forward calls, which conversion's scan of forward sources does not see
    (tests/unit/test_convert_edges.py has the read in forward itself, caught at conversion)."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(32, 32)
        self.tied = nn.Linear(32, 32)

    def forward(self, x):
        return self._project_tied(self.used(x))

    def _project_tied(self, h):
        return F.linear(h, self.tied.weight)


def test_unowned_converted_layer_warns_once_after_the_first_event():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = _ReadsWeightOutside()
    state.convert(model)
    assert state.last_conversion.converted == ["used", "tied"]  # no static rule can see it
    state.convert(model)  # converting again (as the Lightning callback does) keeps the check armed
    assert state.last_conversion.converted == []
    with pytest.warns(f8s.ConversionWarning, match=r"1 converted layer\(s\) never ran .*: tied\."):
        events(state, model, n=1)
    assert state.conversion.unowned(state) == ["tied"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", f8s.ConversionWarning)
        events(state, model, n=2, seed=1, step0=1)  # once only
    # excluding it makes the report honest and the warning go away
    state2 = f8s.Fp8State(f8s.QuantConfig(exclude=("tied",)))
    model2 = _ReadsWeightOutside()
    state2.convert(model2)
    assert state2.last_conversion.skipped == {"tied": "matches an exclude pattern ['tied']"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", f8s.ConversionWarning)
        events(state2, model2, n=1)


class _CustomLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_report_lists_every_candidate_with_a_reason():
    model = nn.Sequential(
        nn.Linear(8, 8),
        _CustomLinear(8, 8),
        nn.MultiheadAttention(8, 2),
        GPT2Mlp(8),
        nn.Linear(8, 8),
    )
    state = f8s.Fp8State(f8s.QuantConfig(exclude=("4",)))
    state.convert(model)
    report = state.last_conversion
    statuses = {name: status for name, status, _ in report.entries()}
    assert statuses == {
        "0": "converted",
        "2.in_proj": "converted",
        "2.out_proj": "converted",
        "3.c_fc": "converted",
        "3.c_proj": "converted",
        "1": "not quantizable",
        "4": "skipped",
    }
    assert all(reason for _, _, reason in report.entries())
    assert "its own forward" in report.not_quantizable["1"]
    assert report.counts() == {
        "converted": 5,
        "skipped": 1,
        "not quantizable": 1,
        "converted nn.Linear": 1,
        "converted nn.Linear subclass NonDynamicallyQuantizableLinear": 1,
        "converted nn.MultiheadAttention in_proj_weight [3E, E]": 1,
        "converted transformers Conv1D": 2,
    }
    assert report.summary() == (
        "converted 5 layer(s) (1 nn.Linear, 1 nn.Linear subclass NonDynamicallyQuantizableLinear, "
        "1 nn.MultiheadAttention in_proj_weight [3E, E], 2 transformers Conv1D), skipped 1, not quantizable 1"
    )
    assert "\n" not in report.summary()
    assert len(str(report).splitlines()) == 1 + 7
    assert json.loads(json.dumps(report.to_dict()))["counts"]["converted"] == 5
    root = f8s.Fp8State(f8s.QuantConfig())
    root.convert(nn.Linear(4, 4))
    assert "root module itself" in root.last_conversion.not_quantizable[""]
