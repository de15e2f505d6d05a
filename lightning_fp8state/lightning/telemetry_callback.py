"""TelemetryCallback: training-effective telemetry and the non-finite guard in Lightning.

A thin driver of :class:`~lightning_fp8state.telemetry.TrainingTelemetry`: Lightning's hooks
feed it tokens, losses and gradients; its rows go to a JSONL file in the run directory
(always, whatever the loggers) and to every Lightning logger; the progress bar shows loss,
effective tokens/s and skipped steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override

from ..config import require_bool, require_choice, require_int, require_number, require_type
from ..errors import ConfigError
from ..telemetry import JSONL_NAME, TrainingTelemetry, count_tokens, read_engine_step
from ..telemetry.engines import FOUND_INF_ATTR
from ..telemetry.metrics import SOURCE_GROUPINGS

__all__ = ["LightningLoggerSink", "TelemetryCallback", "wandb_logger"]

_NOT_FOR_LOGGERS = ("step", "time")


def wandb_logger(save_dir: str | os.PathLike, *, project: str = "lightning_fp8state", online: bool = False, **kwargs):
    """A ``WandbLogger`` that runs offline unless ``online=True``: no account, no network.

    The run lands in ``<save_dir>/wandb/offline-run-*``; ``wandb sync`` uploads it later.
    ``kwargs`` go to ``WandbLogger`` (name, tags, log_model, ...).

    The mode also goes to ``wandb.init`` itself: ``WandbLogger(offline=True)`` only sets
    ``WANDB_MODE`` in the environment, which W&B reads once per process, so after any earlier
    W&B run in the process (a :class:`~lightning_fp8state.telemetry.WandbSink`, another
    logger) it would go online and ask for an API key.
    """
    if rank_zero_only.rank == 0:  # W&B writes on global rank 0 only: other ranks create nothing
        os.makedirs(save_dir, exist_ok=True)
    mode = kwargs.pop("mode", "online" if online else "offline")
    logger = WandbLogger(save_dir=str(save_dir), project=project, offline=mode == "offline", mode=mode, **kwargs)
    if logger._wandb_init.get("anonymous") is None:  # Lightning passes anonymous=None, which W&B
        logger._wandb_init.pop("anonymous", None)  # warns about on every run ("has no effect")
    return logger


class LightningLoggerSink:
    """Writes telemetry rows to every logger of a trainer, each row at its own step.

    Numbers go to every logger; text values (the dominant gradient source's name) only to
    W&B, the one logger here that takes text.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        for logger in self.trainer.loggers:
            text_ok = isinstance(logger, WandbLogger)
            for row in rows:
                metrics = {
                    k: v
                    for k, v in row.items()
                    if k not in _NOT_FOR_LOGGERS
                    and ((isinstance(v, (int, float)) and not isinstance(v, bool)) or (text_ok and isinstance(v, str)))
                }
                logger.log_metrics(metrics, step=int(row["step"]))
            logger.save()

    def close(self) -> None:
        pass


class TelemetryCallback(Callback):
    """Per optimizer step: steps attempted/applied/skipped, loss, lr, gradient norm before
    clipping, dominant gradient source, clipping, finiteness, raw and effective tokens/s,
    and the quantizer's health; a guard skips steps whose gradients are not finite.

    Example::

        trainer = Trainer(
            logger=lightning_fp8state.lightning.wandb_logger("runs/a"),  # offline W&B
            callbacks=[TelemetryCallback(log_every_n_steps=10)],
        )

    Args:
        run_dir: where ``telemetry.jsonl`` goes (default: ``trainer.log_dir``, which is the
            first logger's directory or ``default_root_dir`` without loggers).
        log_every_n_steps: optimizer steps per window (default: the trainer's).
        guard: skip optimizer steps whose gradients are not all finite, so parameters and
            optimizer state stay exactly as they were. With a fused optimizer
            (``torch.optim.AdamW(..., fused=True)``) the optimizer skips the step on the
            device: no host sync. With any other, the flag is read on the host (one sync per
            optimizer step) and the gradients are set to ``None`` before Lightning clips and steps.
        tokens_per_batch: tokens in a batch: an int, a function of the batch, or ``None``
            (integer tensors count elements, floating ones rows; see ``count_tokens``).
            Throughput is global: this rank's tokens times the world size.
        state: the ``Fp8State`` to report on (default: the one driving the model's
            converted layers, if any).
        dominant_by: ``"layer"`` or ``"parameter"``.
        saturation: report each owner's saturated fraction over the logging window (counted
            by the quantize kernels on the device: eager and CUDA graph replays alike).
        per_owner: per-owner quantizer keys (scales, amaxes, saturation).
        per_expert: per-expert keys of the model's mixture-of-experts layers: tokens per expert
            and idle experts per step, scales and amaxes by expert on log steps (read from the
            routing's host counts: no device read between log steps).
        progress_bar: show loss, effective tokens/s and skipped steps (refreshed on log steps,
            as host numbers: the bar reads nothing from the device between them).
        clip_threshold: count clip events against this (default: ``trainer.gradient_clip_val``).
        apply_clipping: clip the gradients here, at ``clip_threshold`` by norm, with the norm
            the callback measured anyway (one norm pass a step, not two). Leave the trainer's
            ``gradient_clip_val`` unset then. Lightning's mixed-precision plugin refuses to clip
            for a fused optimizer (it guards fp16 loss scaling, also under bf16), so this is
            how a fused optimizer is clipped. Refused with fp16 loss scaling (the gradients
            the callback sees are still scaled there) and under DeepSpeed.
    """

    def __init__(
        self,
        *,
        run_dir: str | os.PathLike | None = None,
        log_every_n_steps: int | None = None,
        guard: bool = True,
        tokens_per_batch: int | Callable[[Any], int] | None = None,
        state=None,
        dominant_by: str = "layer",
        saturation: bool = True,
        per_owner: bool = True,
        per_expert: bool = True,
        progress_bar: bool = True,
        clip_threshold: float | None = None,
        apply_clipping: bool = False,
        jsonl_name: str = JSONL_NAME,
    ) -> None:
        require_int("log_every_n_steps", log_every_n_steps, 1, optional=True)
        if not callable(tokens_per_batch):
            require_type(
                "tokens_per_batch", tokens_per_batch, (int, type(None)), "an int, a function of the batch or None"
            )
        require_choice("dominant_by", dominant_by, SOURCE_GROUPINGS)
        flags = {"guard": guard, "saturation": saturation, "per_owner": per_owner, "per_expert": per_expert}
        flags["progress_bar"] = progress_bar
        for key, value in {**flags, "apply_clipping": apply_clipping}.items():
            require_bool(key, value)
        require_number(
            "clip_threshold",
            clip_threshold,
            0,
            low_open=True,
            optional=not apply_clipping,
            why="apply_clipping=True clips the gradients at it" if apply_clipping else "",
        )
        self.run_dir = run_dir
        self.log_every_n_steps = log_every_n_steps
        self.guard = guard
        self.tokens_per_batch = tokens_per_batch
        self.state = state
        self.dominant_by = dominant_by
        self.saturation = saturation
        self.per_owner = per_owner
        self.per_expert = per_expert
        self.progress_bar = progress_bar
        self.clip_threshold = clip_threshold
        self.apply_clipping = apply_clipping
        self.jsonl_name = jsonl_name
        self.telemetry: TrainingTelemetry | None = None
        self._engine = None
        self._world_size = 1
        self._restored: dict | None = None
        # one line per telemetry sink that failed during the last run (also warned at its end)
        self.sink_failures: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        run_dir = self.run_dir if self.run_dir is not None else (trainer.log_dir or trainer.default_root_dir)
        engine = trainer.model if read_engine_step(trainer.model) is not None else None
        guard = self.guard
        if engine is not None and guard and hasattr(engine, FOUND_INF_ATTR):
            guard = False  # the strategy's device guard (lightning.deepspeed_guard) skips and reports
        elif engine is not None and guard:
            rank_zero_warn(
                "TelemetryCallback: DeepSpeed keeps gradients in its own buffers, so the non-finite "
                "guard only reports here; DeepSpeed's fp16 loss scaler skips overflowing steps itself "
                "and those are counted as skipped (train/steps_skipped_loss_scale)."
            )
            guard = False
        threshold, algorithm = self.clip_threshold, "norm"
        if self.apply_clipping and trainer.gradient_clip_val:
            raise ConfigError(
                f"TelemetryCallback(apply_clipping=True) and Trainer(gradient_clip_val={trainer.gradient_clip_val!r}) "
                "would both clip: clip in one place (leave gradient_clip_val unset)"
            )
        if self.apply_clipping and getattr(getattr(trainer, "precision_plugin", None), "scaler", None) is not None:
            raise ConfigError(
                "TelemetryCallback(apply_clipping=True) with fp16 loss scaling is not allowed: the gradients are "
                "still scaled when the callback sees them (the scaler unscales later, or inside a fused "
                "optimizer's step), so the threshold would not apply; use bf16, or clip with the trainer's "
                "gradient_clip_val and an unfused optimizer"
            )
        if engine is not None and self.apply_clipping:
            raise ConfigError(
                "TelemetryCallback(apply_clipping=True) under DeepSpeed is not allowed: DeepSpeed keeps the "
                "gradients in its own buffers and clips them itself (set the trainer's gradient_clip_val)"
            )
        if engine is None and pl_module.automatic_optimization and trainer.gradient_clip_val:
            threshold = threshold if threshold is not None else float(trainer.gradient_clip_val)
            algorithm = str(
                getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm"
            )
        sinks = [LightningLoggerSink(trainer)] if trainer.is_global_zero else []
        self.telemetry = TrainingTelemetry(
            run_dir,
            model=pl_module,
            state=self.state,
            log_every=self.log_every_n_steps or trainer.log_every_n_steps or 50,
            guard=guard,
            max_grad_norm=threshold,
            clip_algorithm=algorithm,
            apply_clipping=self.apply_clipping,  # else Lightning clips; we count
            dominant_by=self.dominant_by,
            saturation=self.saturation,
            per_owner=self.per_owner,
            per_expert=self.per_expert,
            sinks=sinks,
            jsonl_name=self.jsonl_name,
            write=trainer.is_global_zero,
        )
        if self._restored is not None:
            self.telemetry.load_state_dict(self._restored)
            self._restored = None
        self._engine = engine
        self._world_size = trainer.world_size

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()  # the rows measured so far are written: they may explain the failure

    def _close(self) -> None:
        if self.telemetry is not None:
            self._restored = self.telemetry.state_dict()
            self.telemetry.close()
            self.sink_failures = self.telemetry.sink.failure_report()
            self.telemetry = None

    # -- per batch / step ----------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.telemetry is None:
            return
        if self.tokens_per_batch is None:
            tokens = count_tokens(batch)
        elif callable(self.tokens_per_batch):
            tokens = int(self.tokens_per_batch(batch))
        else:
            tokens = self.tokens_per_batch
        self.telemetry.observe_tokens(tokens * self._world_size)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss) -> None:
        if self.telemetry is not None:
            self.telemetry.observe_loss(loss)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self.telemetry is not None:
            self.telemetry.before_optimizer_step(optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch: Any, batch_idx: int
    ) -> None:
        tel = self.telemetry
        if tel is None or not tel.step_pending:  # no optimizer step in this batch (accumulating)
            return
        row = tel.after_optimizer_step(step=trainer.global_step, engine=self._engine)
        if row is not None and self.progress_bar:
            shown = {
                "train/loss": row.get("train/loss"),
                "eff_tok/s": row.get("train/effective_tokens_per_s"),
                "skipped": row.get("train/steps_skipped"),
            }
            for name, value in shown.items():
                if value is not None:  # a CPU tensor: Lightning would put a number on the device,
                    # and the bar would read it back (a sync) on every batch until the next log step
                    value = torch.tensor(float(value), dtype=torch.float32)
                    pl_module.log(name, value, prog_bar=True, logger=False, on_step=True, on_epoch=False)

    # -- checkpoint ----------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.telemetry is not None:
            # a checkpoint is being saved: its steps' rows go to the disk first (a kill after the
            # save would otherwise lose the rows still waiting for the log step, and a resume does
            # not re-run those steps), and the counters saved then include them
            self.telemetry.checkpoint()
            return {"counters": self.telemetry.state_dict()}
        return {"counters": self._restored} if self._restored is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        counters = state_dict.get("counters")
        if counters is None:
            return
        if self.telemetry is not None:
            self.telemetry.load_state_dict(counters)
        else:
            self._restored = dict(counters)
