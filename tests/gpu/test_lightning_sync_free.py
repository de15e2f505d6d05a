"""``fp8state train`` on a GPU: between log steps the Lightning loop reads nothing from the device.

A sync per step (the guard's flag read on the host, a number logged to the progress bar, a
0-d index tensor) keeps the host from running ahead of the GPU, which is what made the FP8
Lightning recipe slower than bf16 at 124M. Steady-state steps run here under
``torch.cuda.set_sync_debug_mode("error")``: the batch's copy to the device, the callbacks'
events, the telemetry (norms, the device guard with the fused AdamW, clipping), the optimizer
step, the LR scheduler and the progress bar.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry.sinks import read_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class SyncFreeSteps(Callback):
    """Steps ``first`` .. ``last`` (0-based optimizer steps) run with syncs raising."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.checked: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.first:
            torch.cuda.set_sync_debug_mode("error")
        if self.first <= trainer.global_step <= self.last:
            self.checked.append(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last + 1:  # after this batch's optimizer step
            torch.cuda.set_sync_debug_mode(0)


@pytest.fixture
def watched(monkeypatch):
    """Adds a SyncFreeSteps to the Trainer the CLI builds; the debug mode is reset after."""
    spy = SyncFreeSteps(first=3, last=9)
    original = pl.Trainer.__init__

    def init(self, *a, callbacks=None, **kw):
        original(self, *a, callbacks=[*(callbacks or []), spy], **kw)

    monkeypatch.setattr(pl.Trainer, "__init__", init)
    try:
        yield spy
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_steady_state_steps_of_the_cli_loop_do_not_sync(tmp_path, monkeypatch, watched, precision):
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            "tiny_gpt_cpu",
            "trainer.accelerator=gpu",
            f"trainer.precision={precision}",
            "trainer.gradient_clip_val=0.5",  # clipped by the telemetry, with the fused AdamW
            "trainer.max_steps=12",
            "trainer.checkpoint_every_n_steps=1000",
            "telemetry.wandb=disabled",
            "telemetry.log_every_n_steps=100",  # no log step inside the watched steps
            "data.num_workers=2",
            f"out_dir={tmp_path / 'runs'}",
        ]
    )
    assert code == 0
    assert watched.checked == list(range(3, 10))
    rows = read_jsonl(tmp_path / "runs" / "tiny_gpt_cpu" / "telemetry.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["train/steps_applied"] == 12  # the device guard's decisions, counted at the end
    assert all(r["train/grad_finite"] == 1.0 for r in rows)
