"""Per-expert telemetry on a GPU (issue 44): counting tokens per expert adds no device sync.

A mixture-of-experts layer reads its per-expert counts on the host once per call (the routing's
one copy); the telemetry reuses those host ints. The syncs of the same non-log steps are counted
with ``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronizing operation) with the
per-expert telemetry on and off: the counts are equal, and not zero (the routing's own copy is
seen, so the count works). The counts logged sum to tokens x top_k.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.nn import GroupedExperts
from lightning_fp8state.telemetry import TrainingTelemetry, read_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, TOP_K, D, FF, T = 8, 2, 64, 128, 256
LOG_EVERY, STEPS = 4, 3  # steps 1..3 are not log steps


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = GroupedExperts(E, D, FF)
        with torch.no_grad():
            self.experts.gate_up_proj.normal_(0, 0.05)
            self.experts.down_proj.normal_(0, 0.05)

    def forward(self, x):
        weights, index = torch.topk(torch.softmax(self.router(x).float(), -1), TOP_K, dim=-1)
        return f8s.checkpoint(self.experts, x, index, weights)


def _syncs_in_steps(tmp_path, per_expert: bool) -> tuple[int, list[dict]]:
    state = f8s.Fp8State(f8s.QuantConfig(exclude=["router"]))
    model = state.convert(_Moe().cuda())
    tel = TrainingTelemetry(tmp_path, model=model, log_every=LOG_EVERY, per_expert=per_expert, saturation=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(T, D, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    syncs = 0
    for step in range(STEPS):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with state.step(step):
                    model(x).float().pow(2).mean().backward()
                tel.observe_tokens(T)
                tel.before_optimizer_step(opt)
                opt.step()
                opt.zero_grad()
                tel.after_optimizer_step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs += sum("synchroniz" in str(w.message) for w in seen)
    tel.close()
    return syncs, read_jsonl(tmp_path / "telemetry.jsonl")


def test_tokens_per_expert_add_no_device_sync(tmp_path):
    on, rows = _syncs_in_steps(tmp_path / "on", per_expert=True)
    off, _ = _syncs_in_steps(tmp_path / "off", per_expert=False)
    assert off > 0, "no sync seen at all: set_sync_debug_mode('warn') did not report the routing's host copy"
    assert on == off, (on, off)
    assert len(rows) == STEPS
    for row in rows:
        counts = [row[f"fp8state/expert_tokens/experts/{e}"] for e in range(E)]
        assert sum(counts) == T * TOP_K
        assert row["fp8state/experts_idle/experts"] == sum(1 for n in counts if n == 0)
