"""Telemetry under a real DeepSpeed engine with fp16 loss scaling (GPU only).

DeepSpeed's dynamic loss scaler skips the optimizer step when the scaled gradients overflow;
the telemetry must read that skip from the engine and report it like its own guard's.
"""

from __future__ import annotations

import pytest
import torch

from tests.telemetry.helpers import TinyModule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (DeepSpeed engines need CUDA)"),
]


class OverflowAt(TinyModule):
    """Multiplies the loss at one optimizer step so the fp16-scaled gradients overflow."""

    def __init__(self, at: int) -> None:
        super().__init__(n_batches=32)
        self.at = at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1e8 if self.global_step == self.at else loss


def test_deepspeed_fp16_skipped_steps_are_read_and_reported(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_fp8state.lightning import TelemetryCallback
    from lightning_fp8state.telemetry.sinks import read_jsonl

    module = OverflowAt(at=4)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=DeepSpeedStrategy(stage=2, logging_batch_size_per_gpu=8),  # batches come pre-made
        precision="16-mixed",
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[TelemetryCallback(run_dir=tmp_path, log_every_n_steps=1)],
    )
    trainer.fit(module)
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert len(rows) == 8
    last = rows[-1]
    assert last["train/steps_skipped_loss_scale"] >= 1, last
    assert sum(r["train/skipped"] for r in rows) == last["train/steps_skipped"] >= 1
    assert last["train/steps_applied"] + last["train/steps_skipped"] == last["train/steps_attempted"] == 8
    assert any(r["train/skipped"] == 1 for r in rows[4:6]), [r["train/skipped"] for r in rows]
    assert "train/loss_scale" in last
