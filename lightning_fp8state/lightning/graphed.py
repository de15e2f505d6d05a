"""GraphedTrainingStep: a Lightning training step whose forward and backward replay from a CUDA graph.

At the model sizes where Python issues an eager step slower than the GPU runs it, the Lightning
loop is host-bound whatever the loop itself costs: every layer's per-call Python is paid on every
step. :class:`~lightning_fp8state.GraphedStep` removes it by capturing one event (forward,
``commit_forward``, backward) and replaying it; this class runs it from a manual-optimization
``training_step``:

- the event's number is the one :class:`Fp8StateCallback` would open (``next_event``), and the
  callback stands down for the module's events (``fp8state_drives_events``): GraphedStep opens
  and closes them itself, eagerly for the warm-up and the capture, by its host bookkeeping on a
  replay (the same per-owner records, one commit per owner per event);
- the optimizer steps eagerly, outside the graph, through Lightning (``self.optimizers().step()``):
  the precision plugin, ``on_before_optimizer_step`` (the telemetry's gradient norm, its
  device-side non-finite guard and its clipping, the callback's ledger check), the learning-rate
  schedule and the checkpoints stay Lightning's;
- the gradients live in the graph: they are cleared before the warm-up events and the capture,
  never after; every replay writes them afresh into the same tensors, which the optimizer reads;
- a layer moved by ``QuantConfig.fallback`` makes the graph stale (it holds the layer's old calls):
  the next batch captures again (``GraphedStep.drop_if_stale``), once per move, its gradients
  cleared before that capture as before the first;
- ``on_before_backward`` and ``on_after_backward`` of the callbacks and the module are called
  after the event with its loss (its backward ran inside the event);
- the autocast weight cache is off inside the event: a cast cached outside the capture would
  otherwise be read by every replay, stale after the first optimizer step.

Refused, with a message that names what to change: automatic optimization, a world size above
one, more than one optimizer, a learning-rate scheduler not stepped every optimizer step
(``interval="step"``, ``frequency=1``, no ``ReduceLROnPlateau``: this class steps them), an
auditor (the recompute audit runs Python per call, which a replay does not; the telemetry's
saturation counts are kept by the quantize kernels, so they are the same replayed). Shapes and dtypes of the batch are fixed
at the capture (``drop_last=True``). Gradient accumulation is refused by Lightning itself under
manual optimization (each replay writes the gradients afresh: they could not accumulate anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..config import require_callable
from ..errors import ConfigError
from ..graphs import GraphedStep, require_warmup
from .callback import DRIVES_EVENTS, Fp8StateCallback

__all__ = ["GraphedTrainingStep"]


class GraphedTrainingStep:
    """Forward + backward of each training batch from a CUDA graph, the optimizer step eager.

    Example::

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = GPT(cfg)
                self.graphed = f8s.lightning.GraphedTrainingStep(self, self.model.loss, warmup=3)

            def training_step(self, batch, batch_idx):
                return self.graphed(self, batch)      # runs the optimizer (and the schedule) too

            def configure_optimizers(self):           # fused: one launch, the guard on the device
                return torch.optim.AdamW(self.parameters(), fused=True)

        Trainer(accelerator="gpu", devices=1, precision="bf16-mixed",
                callbacks=[Fp8StateCallback(), TelemetryCallback()])

    Args:
        module: the LightningModule that owns this step; it is switched to manual
            optimization and marked as driving its own quantizer events.
        loss_fn: ``loss_fn(*batch)`` returns the scalar loss of one batch (a tuple or list of
            tensors); it must not call Lightning hooks or ``self.log``.
        warmup: eager events before the capture (at least 1: owners register and calibrate
            their first scale there).
        runner: what runs the events, ``GraphedStep`` by default (a stand-in with its interface
            can run the same loop on the CPU, for tests).
    """

    def __init__(
        self,
        module,
        loss_fn: Callable[..., torch.Tensor],
        *,
        warmup: int = 3,
        runner: Callable[..., Any] | None = None,
    ) -> None:
        require_callable("loss_fn", loss_fn, "a function of the batch")
        require_warmup(warmup)  # checked now: the runner is made at the first batch
        module.automatic_optimization = False
        setattr(module, DRIVES_EVENTS, True)
        self.loss_fn = loss_fn
        self.warmup = warmup
        self.runner_factory = runner  # None: GraphedStep, looked up when the first batch runs
        self.runner = None
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its gradient in the graph)
        self._state = None  # the callback's Fp8State (None without one: a bf16 control)
        self._checked = False

    # -- checks ----------------------------------------------------------------------
    def _check(self, trainer, module) -> None:
        if module.automatic_optimization:
            raise ConfigError(
                "GraphedTrainingStep: the module's automatic_optimization was switched back on; the step runs "
                "the optimizer itself (manual optimization)"
            )
        if trainer.world_size != 1:
            raise ConfigError(
                f"GraphedTrainingStep with a world size of {trainer.world_size} is not supported: the gradient "
                "all-reduce of a distributed strategy runs in its backward hooks, outside any graph; train on one "
                "device, or without graphs"
            )
        optimizers = module.optimizers()
        if isinstance(optimizers, list):
            raise ConfigError(
                f"GraphedTrainingStep with {len(optimizers)} optimizers is not supported: it steps one optimizer "
                "after each replayed event; return one from configure_optimizers"
            )
        for config in trainer.lr_scheduler_configs:
            if config.interval != "step" or config.frequency != 1 or config.reduce_on_plateau:
                found = "ReduceLROnPlateau" if config.reduce_on_plateau else f"interval={config.interval!r}"
                raise ConfigError(
                    f"GraphedTrainingStep with a learning-rate scheduler of {found}, frequency={config.frequency} "
                    "is not supported: it steps each scheduler once after every optimizer step (interval='step', "
                    "frequency=1); use such a scheduler, or step yours in a hook of your own"
                )
        callback = _fp8_callback(trainer)
        auditors = [] if callback is None or callback.state is None else callback.state.protocol.auditors
        if auditors:
            names = sorted({_AUDITOR_SOURCES.get(type(a).__name__, type(a).__name__) for a in auditors})
            raise ConfigError(
                f"GraphedTrainingStep with {', '.join(names)} is not supported: it runs Python on every quantized "
                "call, which a replay does not; audit in a run without graphs"
            )
        self._checked = True

    # -- one batch -------------------------------------------------------------------
    def _event_body(self, *inputs: torch.Tensor) -> torch.Tensor:
        device = inputs[0].device.type if inputs else "cuda"
        # the autocast cache off: a weight cast cached before the capture would be what every
        # replay reads; uncached, the capture records the cast and every replay redoes it
        with torch.autocast(
            device,
            dtype=torch.get_autocast_dtype(device),
            enabled=torch.is_autocast_enabled(device),
            cache_enabled=False,
        ):
            loss = self.loss_fn(*inputs)
        if self._state is not None:
            self._state.commit_forward()
        loss.backward()
        return loss.detach()

    def __call__(self, module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """Run one training batch: the event (eager, captured or replayed), the backward hooks,
        the optimizer step and the learning-rate schedule. Returns the batch's loss (a copy)."""
        trainer = module.trainer
        if not self._checked:
            self._check(trainer, module)
        inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        callback = _fp8_callback(trainer)
        self._state = None if callback is None else callback.state
        if callback is not None:
            step, microbatch = callback.next_event(trainer)
        else:
            step, microbatch = trainer.global_step, 0
        optimizer = module.optimizers()
        if self.runner is None:
            factory = self.runner_factory or GraphedStep
            self.runner = factory(self._state, self._event_body, *inputs, warmup=self.warmup, microbatch=microbatch)
        if self.runner.graph is not None:
            # a layer QuantConfig.fallback moved since the capture: the graph holds its old calls, so it
            # is dropped and this batch captures again, its gradients cleared first (below) as at the first
            self.runner.drop_if_stale()
        if self.runner.graph is None:
            # warm-up and capture: gradients start from None, so the capture allocates them in
            # the graph's memory and every replay writes them afresh (no accumulation)
            optimizer.zero_grad(set_to_none=True)
            loss = self.runner(step, *inputs)
            if self.runner.graph is not None:
                self._grads = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        else:
            for p, g in self._grads:  # a guard that set a gradient to None: the replay writes it again
                if p.grad is not g:
                    p.grad = g
            loss = self.runner(step, *inputs)
        loss = loss.clone()  # the event's output is overwritten by the next replay
        _call_hooks(trainer, module, "on_before_backward", loss)
        _call_hooks(trainer, module, "on_after_backward")
        optimizer.step()
        for config in trainer.lr_scheduler_configs:  # interval "step", frequency 1 (checked)
            config.scheduler.step()
        return loss


# where the auditors a replay cannot serve come from, to name the setting to change
_AUDITOR_SOURCES = {
    "RecomputeAuditor": "Fp8StateCallback(audit=True)",
}


def _fp8_callback(trainer):
    return next((c for c in trainer.callbacks if isinstance(c, Fp8StateCallback)), None)


def _call_hooks(trainer, module, hook: str, *args) -> None:
    """Lightning's order: the callbacks' hook, then the module's."""
    for callback in trainer.callbacks:
        getattr(callback, hook)(trainer, module, *args)
    getattr(module, hook)(*args)
