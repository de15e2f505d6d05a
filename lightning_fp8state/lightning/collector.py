"""ManagedCollection: Python's garbage collector at Lightning's batch boundaries during ``fit``.

The callback form of :class:`~lightning_fp8state.collector.ManagedCollector` (why it exists:
that module's doc). ``fp8state train`` adds it unless ``trainer.gc=automatic``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ..collector import ManagedCollector

__all__ = ["ManagedCollection"]


class ManagedCollection(Callback):
    """Turns Python's automatic collector off for ``fit``'s training and collects after every
    training batch: the young generations, everything every ``full_every_n_steps`` batches, and
    after ``freeze_after`` batches everything once before freezing what is alive (the model, the
    optimizer, the strategy's and the library's state). The collector is restored as it was
    when training ends or fails.

    Args:
        full_every_n_steps: a full collection every this many training batches (at least 1).
        freeze_after: the batch after which the live objects are frozen (at least 1).
    """

    def __init__(self, *, full_every_n_steps: int = 100, freeze_after: int = 2) -> None:
        self.collector = ManagedCollector(full_every_n_steps=full_every_n_steps, freeze_after=freeze_after)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.collector.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.collector.active:
            self.collector.step_end()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.collector.stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.collector.stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.collector.stop()
