"""``fp8state train`` on the mixture-of-experts Llama (issue 44): the shipped CPU recipe trains,
its experts converted (each expert's projections their own owners) and its routers reported as
kept, no ledger violation, and it resumes from its checkpoint; MoE keys are refused where they do
not apply, naming the key."""

from __future__ import annotations

import json

import pytest

from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry.sinks import read_jsonl


@pytest.fixture
def run_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def train_tiny_moe(run_root):
    out = f"out_dir={run_root / 'runs'}"
    assert main(["train", "llama_moe_tiny_cpu", "trainer.max_steps=8", "trainer.checkpoint_every_n_steps=4", out]) == 0
    return run_root / "runs" / "llama_moe_tiny_cpu"


def test_the_tiny_moe_recipe_trains(run_root):
    run = train_tiny_moe(run_root)
    entries = {e["name"]: e for e in json.loads((run / "conversion.json").read_text())["entries"]}
    experts = entries["model.layers.1.mlp.experts"]
    assert experts["status"] == "converted" and "Fp8Experts" in experts["reason"]
    router = entries["model.layers.1.mlp.gate"]
    assert router["status"] == "skipped" and "kept in high precision" in router["reason"]
    rows = read_jsonl(run / "telemetry.jsonl")
    assert len(rows) == 8 and all(
        r["fp8state/ledger_violations"] == 0 for r in rows if "fp8state/ledger_violations" in r
    )
    assert any("fp8state/ledger_violations" in r for r in rows)


def test_the_tiny_moe_run_resumes(run_root):
    run = train_tiny_moe(run_root)
    assert main(["train", "--resume", str(run), "trainer.max_steps=10"]) == 0
    assert read_jsonl(run / "telemetry.jsonl")[-1]["step"] == 10


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["model.moe_experts=4"], "model.moe_experts=4 is not allowed: expected its default 0 with arch='gpt'"),
        (
            ["model.arch=llama", "model.moe_experts=4", "model.moe_top_k=6"],
            "model.moe_top_k=6 is not allowed: expected an integer >= 1 and <= 4",
        ),
    ],
)
def test_moe_keys_are_refused_naming_them(run_root, capsys, extra, message):
    assert main(["train", *extra, "trainer.max_steps=1"]) == 2
    assert message in capsys.readouterr().err


def test_the_naive_audit_of_a_moe_model_reports_the_refused_recompute(capsys):
    """The naive mode changes the recompute's activations, the router sends tokens elsewhere and
    the experts refuse that recompute: the audit reports it (exit 1), not a traceback."""
    assert main(["audit", "llama_moe_tiny_cpu", "quant.mode=naive", "--steps", "2"]) == 1
    out = capsys.readouterr().out
    assert "recompute refused at event 0: StateTransitionError" in out and "routing must be deterministic" in out
    assert "recompute refused (fails closed)" in out
