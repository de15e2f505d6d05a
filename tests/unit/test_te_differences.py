"""Our delayed-scaling rules where they differ from Transformer Engine's (docs/EVIDENCE.md,
"Differences from Transformer Engine's delayed scaling"): one test per row of that table, each
pinning our behaviour with hand-computed values and the TE value it is not.

TE's rules are those of its update kernel (transformer_engine/common/recipe/delayed_scaling.cu:
``scaled_max = fp8_max * 2**-margin``; every ``last_amax`` rolled in except that the bulk
(fused) kernel skips a zero one; ``amax = fmaxf`` over the history; ``scale = scaled_max / amax``
when that amax is finite and > 0, else the old scale; an infinite scale becomes FLT_MAX).
"""

from __future__ import annotations

import struct

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state import ops

FLT_MAX = torch.finfo(torch.float32).max
E4M3 = torch.float8_e4m3fn


def bank(history, scale=1.0):
    """One owner: amax history rows (newest first), scale, descale, counters, E4M3's 448."""
    h = torch.tensor(history, dtype=torch.float32).reshape(-1, 1)
    return {
        "amax_history": h,
        "scale": torch.tensor([scale]),
        "descale": torch.tensor([1.0 / scale]),
        "nonfinite_count": torch.zeros(1, dtype=torch.int32),
    }


def commit(b, pending, *, algo="max", margin=0):
    ops.update_scales(
        b["amax_history"],
        b["scale"],
        b["descale"],
        torch.tensor([pending], dtype=torch.float32),
        b["nonfinite_count"],
        torch.ones(1, dtype=torch.bool),
        torch.tensor([448.0]),
        algo,
        margin,
    )
    return b


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_amax_is_skipped_not_rolled_in(bad):
    """TE rolls it into the history (an inf then blocks every update for history_len steps
    under "max"); we skip it: history and scale unchanged, the event counted."""
    b = commit(bank([2.0, 4.0, 1.0], scale=112.0), bad)
    assert b["amax_history"].flatten().tolist() == [2.0, 4.0, 1.0]
    assert b["scale"].item() == 112.0 and b["nonfinite_count"].item() == 1
    commit(b, 8.0)  # the next finite amax updates at once
    assert b["amax_history"].flatten().tolist() == [8.0, 2.0, 4.0]
    assert b["scale"].item() == 448.0 / 8.0


def test_scale_overflow_keeps_the_old_scale_not_flt_max():
    """fmax / amax overflows float32 for amax < 448 / FLT_MAX: TE sets FLT_MAX, we keep the old
    scale (FLT_MAX's descale, 1 / FLT_MAX, is a float32 subnormal: scale and descale would no
    longer be exact inverses)."""
    b = commit(bank([0.0], scale=3.0), 1e-38)
    assert 448.0 / f32(1e-38) > FLT_MAX  # the case itself
    assert b["scale"].item() == 3.0 and b["scale"].item() != FLT_MAX
    assert b["amax_history"].flatten().tolist() == [f32(1e-38)]  # still recorded


def test_zero_amax_is_rolled_in():
    """TE's fused (bulk) update leaves the history alone for a zero amax; we roll it in like any
    finite amax. The scale only moves for an amax > 0: under "max" it comes from the older
    entries, under "most_recent" it stays."""
    b = commit(bank([2.0, 4.0], scale=1.0), 0.0)
    assert b["amax_history"].flatten().tolist() == [0.0, 2.0]
    assert b["scale"].item() == 448.0 / 2.0
    b = commit(bank([2.0, 4.0], scale=5.0), 0.0, algo="most_recent")
    assert b["amax_history"].flatten().tolist() == [0.0, 2.0]
    assert b["scale"].item() == 5.0


def test_margin_is_applied_after_the_division():
    """Ours: (fmax / amax) / 2**margin; TE: (fmax * 2**-margin) / amax. Dividing by a power of
    two is exact in range, so both agree for ordinary amaxes; they part where fmax / amax
    overflows but the margin would bring it back: TE gets a finite scale, we keep the old."""
    for amax in (1e-3, 0.37, 5.0, 1234.5):
        b = commit(bank([0.0], scale=1.0), amax, margin=3)
        a = f32(amax)
        ours = f32(f32(448.0 / a) / 8.0)
        te = f32(f32(448.0 * 2.0**-3) / a)
        assert b["scale"].item() == ours == te
    b = commit(bank([0.0], scale=7.0), 1e-37, margin=4)
    assert (448.0 * 2.0**-4) / f32(1e-37) < FLT_MAX < 448.0 / f32(1e-37)  # TE finite, ours overflows
    assert b["scale"].item() == 7.0


def test_nan_element_makes_the_recorded_amax_nan():
    """TE's amax reductions use fmaxf, which drops NaN operands (the amax of the other
    elements is recorded); ours propagate NaN, so the event's amax is NaN: its commit is
    skipped and counted (first row of the table) and the NaN element encodes as NaN."""
    x = torch.tensor([1.0, float("nan"), -3.0, 2.0])
    pending = torch.zeros(1)
    q = ops.quantize_fp8_record_amax(x, torch.tensor([1.0]), pending, 0, E4M3)
    assert torch.isnan(pending).item()
    assert pending.view(torch.int32).item() == 0x7FC00000  # canonical NaN
    assert q.view(torch.uint8).tolist()[1] == 0x7F  # E4M3's NaN code
    assert q.float()[[0, 2, 3]].tolist() == [1.0, -3.0, 2.0]
    b = commit(bank([2.0], scale=224.0), float(pending))
    assert b["scale"].item() == 224.0 and b["nonfinite_count"].item() == 1


@pytest.mark.parametrize("initial", ["calibrate", "one"])
def test_first_event_scale(initial):
    """TE quantizes an owner's first step with scale 1; ours (initial_scale="calibrate", the
    default) computes the first event's scale from the tensor itself; "one" is TE's start."""
    state = f8s.Fp8State(f8s.QuantConfig(initial_scale=initial, margin=1))
    torch.manual_seed(0)
    model = state.convert(torch.nn.Sequential(torch.nn.Linear(8, 8)))
    x = torch.randn(4, 8) * 1e-3
    seen = {}

    class Spy:
        def observe(self, record, phase, output, snaps):
            seen.update({role: float(s.scale) for role, s in snaps.items()})

    state.protocol.auditors.append(Spy())
    with state.step(0):
        model(x).sum().backward()
    amax = f32(x.abs().max().item())
    want = f32(f32(448.0 / amax) / 2.0) if initial == "calibrate" else 1.0
    assert seen["input"] == want
