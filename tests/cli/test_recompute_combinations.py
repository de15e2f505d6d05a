"""``fp8state train`` never runs a recompute that differs from its forward: each checkpoint
engine the CLI offers, under bf16 autocast, audited during training (``telemetry.audit``)."""

from __future__ import annotations

import pytest

from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry.sinks import read_jsonl

SMALL = ["model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4", "data.num_samples=64"]


@pytest.mark.parametrize(
    "engine",
    [
        ["model.checkpoint_engine=torch", "model.use_reentrant=false"],
        ["model.checkpoint_engine=torch", "model.use_reentrant=true"],
        ["model.checkpoint_engine=deepspeed"],
    ],
    ids=["torch-nonreentrant", "torch-reentrant", "deepspeed"],
)
def test_every_checkpoint_engine_recomputes_bitwise_under_bf16_autocast(tmp_path, monkeypatch, engine):
    # the 350M recipe's combination on one CPU rank: fp8state_ddp, bf16-mixed, DeepSpeed's engine
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            *SMALL,
            *engine,
            "strategy.name=fp8state_ddp",
            "trainer.precision=bf16-mixed",
            "trainer.max_steps=4",
            "telemetry.audit=true",
            "telemetry.log_every_n_steps=2",
            "telemetry.wandb=disabled",
            f"out_dir={tmp_path / 'runs'}",
        ]
    )
    assert code == 0
    rows = [
        r
        for r in read_jsonl(tmp_path / "runs" / "tiny_gpt_cpu" / "telemetry.jsonl")
        if "fp8state/recomputed_calls" in r
    ]
    assert rows and rows[-1]["fp8state/recomputed_calls"] >= 4 * 2 * 4  # 4 linears x 2 blocks x 4 steps
    assert [r["fp8state/recompute_mismatches"] for r in rows] == [0.0] * len(rows)
