"""Per-expert telemetry (issue 44): tokens per expert per step, idle experts, scales and amaxes by
expert, in the JSONL and in the report's per-expert panel.

A tiny MoE Llama trained through ``fp8state train``: every MoE layer's per-expert token counts sum
to the step's tokens times top-k, and the per-expert scale keys agree with the per-owner keys of
the same owners. A constructed case forces the routing (an expert that gets nothing, two
microbatches, a checkpointed recompute, an evaluation call) and checks the counts, the idle
experts named and the report's table against what the routing says.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.cli.main import main
from lightning_fp8state.nn import GroupedExperts
from lightning_fp8state.telemetry import TrainingTelemetry, read_jsonl, write_report
from tests.telemetry.helpers import wandb_history

TOKENS = "fp8state/expert_tokens/"
SCALE = "fp8state/expert_scale/"


@pytest.fixture
def run_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def _per_layer_tokens(row: dict) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for key, value in row.items():
        if key.startswith(TOKENS):
            layer, e = key.removeprefix(TOKENS).rsplit("/", 1)
            out.setdefault(layer, {})[int(e)] = value
    return out


def test_the_tiny_moe_run_logs_tokens_per_expert_and_the_report_shows_them(run_root, capsys):
    out = f"out_dir={run_root / 'runs'}"
    args = ["train", "llama_moe_tiny_cpu", "trainer.max_steps=4", "telemetry.log_every_n_steps=2", out]
    assert main(args) == 0
    run = run_root / "runs" / "llama_moe_tiny_cpu"
    cfg = OmegaConf.load(run / "config.yaml")
    top_k, n_experts = cfg.model.moe_top_k, cfg.model.moe_experts
    layers = [f"model.layers.{i}.mlp.experts" for i in range(cfg.model.n_layers)]
    rows = read_jsonl(run / "telemetry.jsonl")
    assert len(rows) == 4
    totals = {layer: [0] * n_experts for layer in layers}
    for row in rows:
        per_layer = _per_layer_tokens(row)
        assert sorted(per_layer) == layers
        for layer, counts in per_layer.items():
            assert sorted(counts) == list(range(n_experts))
            # one MoE call per step per layer (one microbatch): every token's top-k choices
            assert row[f"fp8state/expert_calls/{layer}"] == 1
            assert sum(counts.values()) == row["train/tokens"] * top_k == cfg.data.batch_size * cfg.model.seq_len * 2
            idle = [e for e in range(n_experts) if counts[e] == 0]
            assert row[f"fp8state/experts_idle/{layer}"] == len(idle)
            assert row[f"fp8state/experts_idle_ids/{layer}"] == ",".join(map(str, idle))
            for e in range(n_experts):
                totals[layer][e] += counts[e]
    # log steps: each expert's scale and amax by projection and role, the same numbers the
    # per-owner keys give for the owners of layer <experts>.<projection>.<e>
    logged = [r for r in rows if any(k.startswith(SCALE) for k in r)]
    assert [r["step"] for r in logged] == [2, 4]
    for row in logged:
        checked = 0
        for layer in layers:
            for proj in ("gate_up_proj", "down_proj"):
                for role in ("input", "weight", "grad_output"):
                    for e in range(n_experts):
                        scale = row[f"{SCALE}{layer}/{proj}.{role}/{e}"]
                        amax = row[f"fp8state/expert_amax/{layer}/{proj}.{role}/{e}"]
                        assert scale == row[f"fp8state/scale/{layer}.{proj}.{e}.{role}"] and scale > 0
                        assert amax == row[f"fp8state/amax/{layer}.{proj}.{e}.{role}"]
                        checked += 1
        assert checked == len(layers) * 2 * 3 * n_experts
    # the same keys in the offline W&B run (the idle experts' ids as text)
    history = wandb_history(next(run.glob("wandb/offline-run-*/*.wandb")))
    logged_tokens = [h for h in history if f"{TOKENS}{layers[0]}/0" in h]
    assert [h[f"{TOKENS}{layers[0]}/0"] for h in logged_tokens] == [r[f"{TOKENS}{layers[0]}/0"] for r in rows]
    assert all(
        h[f"fp8state/experts_idle_ids/{layers[0]}"] == r[f"fp8state/experts_idle_ids/{layers[0]}"]
        for h, r in zip(logged_tokens, rows, strict=True)
    )
    assert any(f"{SCALE}{layers[1]}/down_proj.weight/3" in h for h in history)
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out
    png = run / "report" / "experts.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = printed.split("experts (per MoE layer, over 4 steps):\n", 1)[1].splitlines()
    assert table[0].split()[:6] == ["layer", "expert", "tokens", "share", "idle", "steps"]
    body = [line.split() for line in table[1 : 1 + len(layers) * n_experts]]
    for layer in layers:
        mine = [cells for cells in body if cells[0] == layer]
        assert [int(c[1]) for c in mine] == list(range(n_experts))
        assert [int(c[2]) for c in mine] == totals[layer]
        for cells, tokens in zip(mine, totals[layer], strict=True):
            assert float(cells[3]) == pytest.approx(tokens / sum(totals[layer]), abs=5e-4)
            assert cells[4] == f"{sum(1 for r in rows if _per_layer_tokens(r)[layer][int(cells[1])] == 0)}/4"
            assert len(cells) == 5 + 6  # a scale per projection and role: 2 x 3
    assert "MoE layers" in printed and "expert token share" in printed


E, D, FF = 4, 8, 12
# forced top-2 routing per (step, microbatch): expert 2 never chosen; in step 1 expert 3 neither
ROUTES = {
    (0, 0): [[0, 1], [3, 0], [1, 3]],
    (1, 0): [[0, 1], [1, 0], [0, 1]],
    (1, 1): [[1, 0], [0, 1], [1, 0]],
}
WANT_TOKENS = {0: [2, 2, 0, 2], 1: [6, 6, 0, 0]}  # summed over the step's microbatches


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = GroupedExperts(E, D, FF)
        with torch.no_grad():
            self.experts.gate_up_proj.normal_(0, 0.3)
            self.experts.down_proj.normal_(0, 0.3)

    def forward(self, x, index):
        weights = torch.full(index.shape, 0.5)
        return f8s.checkpoint(self.experts, x, index, weights)  # the recompute is not counted


def _forced_run(tmp_path, *, per_expert: bool = True):
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(_Experts())
    tel = TrainingTelemetry(tmp_path, model=model, log_every=2, per_expert=per_expert, saturation=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for step in range(2):
        microbatches = [mb for s, mb in ROUTES if s == step]
        for mb in microbatches:
            with state.step(step, microbatch=mb):
                loss = model(x, torch.tensor(ROUTES[(step, mb)])).pow(2).mean()
                loss.backward()
            tel.observe_tokens(3)
        with torch.no_grad():  # an evaluation call between steps: no token of training
            model(x, torch.tensor([[0, 1]] * 3))
        tel.before_optimizer_step(opt)
        opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()
    return model, read_jsonl(tmp_path / "telemetry.jsonl")


def test_forced_routing_names_the_idle_experts(tmp_path, capsys):
    model, rows = _forced_run(tmp_path)
    layer = "experts"
    assert [row["step"] for row in rows] == [1, 2]
    for step, row in enumerate(rows):
        assert [row[f"{TOKENS}{layer}/{e}"] for e in range(E)] == WANT_TOKENS[step]
        assert row[f"fp8state/expert_calls/{layer}"] == (1, 2)[step]
    assert rows[0]["fp8state/experts_idle/experts"] == 1 and rows[0]["fp8state/experts_idle_ids/experts"] == "2"
    assert rows[1]["fp8state/experts_idle/experts"] == 2 and rows[1]["fp8state/experts_idle_ids/experts"] == "2,3"
    # expert 2 was never entered: it has no owner, so no scale; the others have one per role
    scales = {k.removeprefix(SCALE) for k in rows[1] if k.startswith(SCALE)}
    roles = ("input", "weight", "grad_output")
    want = {f"{layer}/{p}.{r}/{e}" for p in ("gate_up_proj", "down_proj") for r in roles for e in (0, 1, 3)}
    assert scales == want
    assert model.experts.routing_observer is None  # closed: the calls do no telemetry work
    report = write_report(tmp_path, show=False)
    assert [(r.expert, r.tokens, r.idle_steps, r.steps) for r in report.experts] == [
        (0, 8, 0, 2),
        (1, 8, 0, 2),
        (2, 0, 2, 2),
        (3, 2, 1, 2),
    ]
    assert report.experts[3].share == pytest.approx(2 / 18)
    assert report.summary["idle experts (last step)"] == "experts: 2,3"
    assert report.summary["expert-steps idle"] == 3
    assert "experts" in report.plots and report.plots["experts"].stat().st_size > 0


def test_per_expert_off_adds_no_key_and_no_hook(tmp_path):
    model, rows = _forced_run(tmp_path, per_expert=False)
    assert not [k for row in rows for k in row if k.startswith(("fp8state/expert", "fp8state/experts"))]
    assert "fp8state/scale/experts.gate_up_proj.0.input" in rows[1]  # the per-owner keys as before
    assert model.experts.routing_observer is None
    report = write_report(tmp_path, show=False)
    assert report.experts == [] and "experts" not in report.plots and "MoE layers" not in report.summary
    assert json.dumps(report.summary)  # plain values
