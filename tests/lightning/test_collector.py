"""ManagedCollection: Python's collector off during fit's training, run at each batch's end,
restored when training ends or fails."""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_fp8state.lightning import ManagedCollection


class Seen(Callback):
    """Whether Python's automatic collector was on at each training batch, and the freeze count."""

    def __init__(self) -> None:
        self.enabled: list[bool] = []
        self.frozen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.enabled.append(gc.isenabled())
        self.frozen.append(gc.get_freeze_count())


class FailsAtBatch(BoringModel):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def trainer(tmp_path, *callbacks) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=5,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


@pytest.fixture
def collector_on():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
    gc.enable()


def test_training_runs_with_the_collector_managed_and_gets_it_back_after(tmp_path, collector_on):
    seen, managed = Seen(), ManagedCollection(full_every_n_steps=3, freeze_after=2)
    trainer(tmp_path, managed, seen).fit(BoringModel())
    assert seen.enabled == [False] * 5
    assert seen.frozen[:2] == [0, 0] and all(n > 0 for n in seen.frozen[2:])  # frozen after batch 2
    assert managed.collector.collections == {"young": 3, "full": 2}  # batch 2 (freeze) and 3 full
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_failing_training_step_gives_the_collector_back(tmp_path, collector_on):
    managed = ManagedCollection(freeze_after=1)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, managed).fit(FailsAtBatch(at=3))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert not managed.collector.active
