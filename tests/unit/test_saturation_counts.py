"""Saturation counted by the quantize ops themselves (``StateBank.saturation``), not by Python.

The reference ops add, per owner, the elements whose ``|float32(y) * scale|`` exceeds the
format's max and the elements encoded: checked here against a plain torch count on every
recording FP8 op. The telemetry's fractions come from those counters over the whole logging
window; and since a replayed graph runs the ops (no Python), a graphed run (emulated:
tests/graph_emulation.py) counts and logs exactly what the eager run does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import lightning_fp8state as f8s
from lightning_fp8state import ops
from lightning_fp8state.errors import ConfigError
from lightning_fp8state.formats import fp8_format
from lightning_fp8state.graphs import GraphedBlocks
from lightning_fp8state.telemetry import TrainingTelemetry, owner_label, read_jsonl
from tests.conftest import Block, bitwise_equal
from tests.graph_emulation import EmulatedGraphBackend

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _plain_count(y: torch.Tensor, scale: float, dtype) -> int:
    return int(((y.float() * scale).abs() > fp8_format(dtype).max).sum())


def _data(shape, seed, dtype=torch.float32, noncontig=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    if noncontig:
        wide = torch.zeros(*shape[:-1], shape[-1] * 2, dtype=dtype)
        wide[..., 1::2] = x
        return wide[..., 1::2]
    return x


def _counter(owners=3):
    return torch.zeros(owners), torch.full((2, owners), 5, dtype=torch.int64)  # counts already there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("shape,noncontig", [((0, 8), False), ((33, 40), False), ((33, 40), True)])
def test_quantize_record_adds_the_plain_count(dtype, fmt, shape, noncontig):
    x = _data(shape, 1, dtype, noncontig)
    scale = fp8_format(fmt).max / 6.0  # |x| > 6 clips: a few % of 4 N(0, 1)
    pending, sat = _counter()
    q = ops.quantize_fp8_record_amax(x, torch.tensor(scale), pending, 1, fmt, sat)
    want = _plain_count(x, scale, fmt)
    assert sat[:, 1].tolist() == [5 + want, 5 + x.numel()]
    assert sat[:, [0, 2]].eq(5).all()
    if x.numel():
        assert 0 < want < x.numel()
    assert bitwise_equal(q, ops.quantize_fp8(x, torch.tensor(scale), fmt))  # the codes as before
    if x.dim() == 2:
        pending2, sat2 = _counter()
        ops.quantize_fp8_t_record_amax(x, torch.tensor(scale), pending2, 2, fmt, True, sat2)
        assert sat2[:, 2].tolist() == [5 + want, 5 + x.numel()]


def test_an_infinity_clips_a_nan_does_not():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 448.0, 449.0, -1e6])
    pending, sat = _counter()
    ops.quantize_fp8_record_amax(x, torch.tensor(1.0), pending, 0, E4M3, sat)
    assert sat[:, 0].tolist() == [5 + 4, 5 + 6]


def test_the_fused_prologues_count_what_they_encode():
    """GELU, LayerNorm, RMSNorm and SwiGLU: the count of their output (computed here by torch),
    not of their input."""
    x = _data((16, 64), 2)
    s = torch.tensor(448.0 / 1.5)
    w, b = torch.randn(64, generator=torch.Generator().manual_seed(3)), torch.zeros(64)
    gelu = F.gelu(x)
    ln = F.layer_norm(x, (64,), w, b, 1e-5)
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    swiglu = F.silu(x[:, :32]) * x[:, 32:]
    calls = {
        "gelu": (lambda p, c: ops.gelu_quantize_fp8(x, s, E4M3, p, 0, c), gelu),
        "layer_norm": (lambda p, c: ops.layer_norm_quantize_fp8(x, w, b, 1e-5, s, E4M3, p, 0, c), ln),
        "rms_norm": (lambda p, c: ops.rms_norm_quantize_fp8(x, w, 1e-6, s, E4M3, p, 0, c), rms),
        "swiglu": (lambda p, c: ops.swiglu_quantize_fp8(x, s, E4M3, p, 0, c), swiglu),
    }
    for name, (call, y) in calls.items():
        pending, sat = _counter(1)
        call(pending, sat)
        want = _plain_count(y, s.item(), E4M3)
        # torch's own norms/activations may differ from ours in the last bit: near-equal counts
        assert abs(sat[0, 0].item() - 5 - want) <= max(2, want // 50), name
        assert sat[1, 0].item() - 5 == y.numel() and sat[0, 0].item() > 5 + y.numel() // 100, name
        assert sat[0, 0].item() - 5 < y.numel(), name


def test_a_wrong_counter_is_refused():
    x, pending = torch.randn(4, 8), torch.zeros(3)
    with pytest.raises(ConfigError, match=r"saturation.dtype=torch.int32 is not allowed"):
        ops.quantize_fp8_record_amax(x, torch.tensor(1.0), pending, 0, E4M3, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ConfigError, match=r"saturation.shape=\(2, 2\) is not allowed: expected \(2, 3\)"):
        ops.quantize_fp8_record_amax(x, torch.tensor(1.0), pending, 0, E4M3, torch.zeros(2, 2, dtype=torch.int64))


def test_opcheck_with_a_counter():
    x, s = torch.randn(8, 64), torch.tensor([2.0])
    pending, sat = torch.zeros(2), torch.zeros(2, 2, dtype=torch.int64)
    torch.library.opcheck(torch.ops.fp8state.quantize_fp8_record_amax.default, (x, s, pending, 1, E4M3, sat))
    torch.library.opcheck(torch.ops.fp8state.quantize_fp8_t_record_amax.default, (x, s, pending, 1, E5M2, False, sat))
    torch.library.opcheck(
        torch.ops.fp8state.layer_norm_quantize_fp8_record_amax.default, (x, None, None, 1e-5, s, pending, 0, E4M3, sat)
    )
    f8 = torch.ops.fp8state
    torch.library.opcheck(f8.gelu_quantize_fp8_record_amax.default, (x, s, pending, 0, E4M3, sat))
    torch.library.opcheck(f8.rms_norm_quantize_fp8_record_amax.default, (x, None, 1e-6, s, pending, 0, E4M3, sat))
    torch.library.opcheck(f8.swiglu_quantize_fp8_record_amax.default, (x, s, pending, 0, E4M3, sat))


# -- the telemetry's window ------------------------------------------------------------------
def test_the_logged_fraction_covers_every_step_of_the_window(tmp_path):
    """log_every=2: the fraction is over both steps' encodes (the Python probe counted the log
    step only), checked against an independent count of what each step clipped."""
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig())
    lin = state.convert(nn.Sequential(nn.Linear(32, 16, bias=False)))
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    tel = TrainingTelemetry(tmp_path, model=lin, state=state, log_every=2)
    g = torch.Generator().manual_seed(3)
    hits = elements = 0
    for step in range(4):
        x = torch.randn(8, 32, generator=g)
        if step >= 2:  # outliers in both steps of the second window, more in the first of them
            x[0, : 12 - 4 * (step - 2)] *= 60.0
            owner = next(o for o in state.bank.owners if o.role == "input")
            hits += _plain_count(x, state.scale_of(owner).item(), E4M3)
            elements += x.numel()
        with state.step(step):
            lin(x).sum().backward()
        tel.before_optimizer_step(opt)
        tel.after_optimizer_step()
    tel.close()
    last = read_jsonl(tmp_path / "telemetry.jsonl")[-1]
    assert hits >= 12
    assert last[f"fp8state/saturated_frac/{owner_label(owner)}"] == pytest.approx(hits / elements)


# -- graphed (emulated) and eager count the same -----------------------------------------------
D = 16


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(D, gain=1.0 + i) for i in range(2))
        self.runner = None

    def forward(self, x):
        if self.runner is not None:
            return self.runner(x)
        for block in self.blocks:
            x = f8s.checkpoint(block, x, engine="torch", use_reentrant=False)
        return x


def _train(graphed: bool, tmp_path):
    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(_Net())
    backend = EmulatedGraphBackend()
    if graphed:
        model.runner = GraphedBlocks(model.blocks, warmup=2, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    tel = TrainingTelemetry(tmp_path, model=model, state=state, log_every=2)
    g = torch.Generator().manual_seed(1)
    for step in range(7):
        x = torch.randn(8, D, generator=g) * (1.7**step)  # growing faster than the delayed scales
        with state.step(step):
            y = model(x)
            loss = y.float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        tel.before_optimizer_step(opt)
        opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()
    rows = [r for r in read_jsonl(tmp_path / "telemetry.jsonl") if "fp8state/owners" in r]
    return state, model, backend, rows


def test_graphed_and_eager_runs_count_and_log_the_same_saturation(tmp_path):
    ref_state, _, _, ref_rows = _train(False, tmp_path / "eager")
    state, model, backend, rows = _train(True, tmp_path / "graphed")
    assert model.runner.replays == 5 and all(g.replays == 5 for g in backend.graphs)
    assert bitwise_equal(ref_state.bank.saturation, state.bank.saturation)
    assert int(state.bank.saturation[0].sum()) > 0  # something clipped
    keys = sorted(k for k in ref_rows[-1] if k.startswith("fp8state/saturated_frac"))
    assert len(keys) > 2
    for a, b in zip(ref_rows, rows, strict=True):
        assert [a.get(k) for k in keys] == [b.get(k) for k in keys]
    assert any(r.get("fp8state/saturated_frac_max", 0) > 0 for r in rows[1:])


def _fallback_run(graphed: bool):
    """Inputs 30x the last from step 2 on: the delayed input scales clip most of each event."""
    cfg = f8s.QuantConfig(fallback=True, fallback_on_nonfinite=False, fallback_patience=2, strict=False)
    state = f8s.Fp8State(cfg)
    model = state.convert(_Net())
    if graphed:
        model.runner = GraphedBlocks(model.blocks, warmup=1, backend=EmulatedGraphBackend())
    g = torch.Generator().manual_seed(2)
    moved = []
    for step in range(6):
        x = torch.randn(8, D, generator=g) * (30.0 ** max(step - 1, 0))
        with state.step(step):
            model(x).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        moved.append(dict(state.protocol.fallen_back))
    return state, model, moved


def test_the_fallbacks_saturation_trigger_sees_replayed_calls():
    """The fallback's saturation streaks read the kernels' counters, so replayed blocks move the
    same layers at the same steps as the eager run (they saw no saturation when Python counted)."""
    ref_state, _, ref_moved = _fallback_run(False)
    state, model, moved = _fallback_run(True)
    assert model.runner.replays > 0
    assert moved == ref_moved and moved[-1], moved
    assert {e.reason for e in state.protocol.fallback.events} == {"saturation"}
