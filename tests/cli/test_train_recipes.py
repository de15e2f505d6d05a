"""``fp8state train`` on the CPU with each stateless recipe (issue 28): a few steps through the
Lightning callback, checkpointed blocks, telemetry of the recipe's own fields."""

from __future__ import annotations

import pytest
import torch

from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry.sinks import read_jsonl

TINY = ["model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4", "data.num_samples=64"]


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise"])
def test_train_runs_each_stateless_recipe(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    code = main(
        [
            "train",
            *TINY,
            f"quant.recipe={recipe}",
            "trainer.max_steps=4",
            "telemetry.log_every_n_steps=2",
            "telemetry.wandb=disabled",
            f"out_dir={tmp_path / 'runs'}",
        ]
    )
    assert code == 0
    run = tmp_path / "runs" / "tiny_gpt_cpu"
    rows = read_jsonl(run / "telemetry.jsonl")
    assert rows[-1]["train/steps_applied"] == 4 and rows[-1]["train/steps_skipped"] == 0
    logged = {k for r in rows for k in r}
    assert "fp8state/amax_max" in logged and "fp8state/scale_max" in logged
    assert any(k.startswith("fp8state/amax/") and k.endswith(".input") for k in logged)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    saved = ckpt["fp8state"]["ranks"][0]
    assert saved["config"]["recipe"] == recipe and saved["bank"]["owners"] == []  # stateless: no bank
    assert saved["ledger"]["owners"]  # the ledger counted every owner
