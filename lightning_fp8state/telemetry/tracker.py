"""TrainingTelemetry: training-effective metrics and the non-finite guard for one process.

The plain-PyTorch API; the Lightning callback (``lightning_fp8state.lightning``) drives the
same object from its hooks. Per optimizer step it measures, on the device: loss, gradient
norm before clipping, the dominant gradient source and its share, clipping, finiteness.
Steps are counted (attempted, applied, skipped) on the host. On log steps the window moves
to the host in one transfer and every step of it becomes one row for the sinks, together
with throughput (raw and effective) and quantizer health.

The guard decides on the device when the optimizer can skip a step there (torch's fused
optimizers, ``fused=True``: the ``found_inf`` flag ``torch.amp.GradScaler`` hands them), so
nothing reaches the host between log steps; with any other optimizer it reads one device
scalar per optimizer step (whether every gradient element is finite), the same single sync
``GradScaler.step`` makes there. With ``guard=False`` non-finite steps are only reported.
Applied and skipped steps are counted on the host when the window reaches it (log steps,
``state_dict``).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import require_choice, require_int, require_number
from .engines import FOUND_INF_ATTR, read_engine_step
from .experts import ExpertTelemetry
from .metrics import (
    CLIP_ALGORITHMS,
    SOURCE_GROUPINGS,
    clip_event,
    device_memory,
    gradient_norms,
    gradient_summary,
    loss_summary,
    source_groups,
)
from .quantizer import SaturationWindow, find_protocol, quantizer_health
from .recorder import StepRecorder
from .sinks import JSONL_NAME, FanOut, JsonlSink, Sink

__all__ = ["TrainingTelemetry", "count_tokens"]

_SOURCES = "_sources"  # private row key: the source-name list the dominant index refers to


def count_tokens(batch: Any) -> int:
    """Tokens in a batch, from shapes only (no sync): the first tensor found (in nested
    tuples, lists and dicts); integer tensors (token ids) count every element, floating
    ones count rows (``shape[0]``: samples). 0 if there is no tensor."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return 1
        return batch.numel() if not batch.is_floating_point() and not batch.is_complex() else batch.shape[0]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = count_tokens(item)
            if n:
                return n
    return 0


class _LocalGrad:
    """What torch's clipping functions read of a parameter (its ``grad``): here a DTensor
    gradient's local tensor."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def _clip_targets(params: list, grads: list) -> list:
    """What to clip: ``params``, or where the gradients are DTensors (FSDP2) their local
    tensors, for torch's own clipping functions (duck-typed on ``.grad``). Scaling or clamping
    each element is what DTensor's dispatch does on every shard, bit for bit; through that
    dispatch the clip cost the host a per-tensor placement of the scalar coefficient, every
    step (benchmarks/lightning_host.py under fp8state_fsdp). A ``Partial`` gradient (a pending
    sum, which a clamp does not commute with) keeps the DTensor path."""
    if not any(hasattr(g, "device_mesh") for g in grads if g is not None):
        return params
    if any(p.is_partial() for g in grads if hasattr(g, "device_mesh") for p in g.placements):
        return params
    return [_LocalGrad(g._local_tensor if hasattr(g, "device_mesh") else g) for g in grads if g is not None]


@dataclass
class _Pending:
    device: dict[str, torch.Tensor]
    host: dict[str, Any]
    guard_applied: bool | torch.Tensor  # a host decision, or the device's (1.0: applied)
    flagged: torch.optim.Optimizer | None = None  # holds our ``found_inf`` until the step is counted


def skips_on_device(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Whether ``optimizer.step()`` skips a step flagged in ``optimizer.found_inf`` by itself, on
    the device: torch's fused optimizers (``fused=True`` Adam, AdamW, SGD, Adagrad; the flag
    ``torch.amp.GradScaler`` sets). Their kernels leave parameters and state (moments, step
    count) untouched when the flag is 1. FSDP2's DTensor parameters included: DTensor runs the
    fused kernels per shard and replicates the 0-d flag (``tests/lightning/test_fsdp.py``).

    Every param group must still be fused: ``load_state_dict`` takes the saved groups'
    settings, so an optimizer built fused that loaded a non-fused one's state steps unfused
    (and would refuse the flag)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups
    )


class TrainingTelemetry:
    """Per-optimizer-step telemetry with a non-finite guard, written to a JSONL and sinks.

    Example (a plain loop)::

        tel = TrainingTelemetry("runs/a", model=model, state=state, log_every=10, max_grad_norm=1.0)
        for step, (x, y) in enumerate(loader):
            with state.step(step):
                loss = loss_fn(model(x), y)
                loss.backward()
            if tel.before_optimizer_step(optimizer, loss=loss, tokens=x.numel()):
                optimizer.step()           # skipped when a gradient is not finite
            optimizer.zero_grad()
            tel.after_optimizer_step()     # writes the window's rows on log steps
        tel.close()

    Args:
        run_dir: the run directory; ``telemetry.jsonl`` is appended there.
        model: the trained module: names the gradient sources (and finds the ``Fp8State``).
        state: the ``Fp8State`` to report on; found from ``model``'s converted layers if omitted.
        log_every: optimizer steps per window (one host transfer and one sink write each).
        guard: skip a step whose gradients are not all finite: on the device with a fused
            optimizer (see :func:`skips_on_device`), else with one host sync per step.
        max_grad_norm: clipping threshold; clip events are counted against it.
        clip_algorithm: ``"norm"`` or ``"value"`` (as Lightning's ``gradient_clip_algorithm``).
        apply_clipping: also clip (reusing the norm already computed); default: when
            ``max_grad_norm`` is given. The Lightning callback only counts: Lightning clips.
        dominant_by: the gradient source granularity, ``"layer"`` or ``"parameter"``.
        saturation: report each owner's saturated fraction over the window, from the clip counts
            the quantize kernels keep on the device (eager and CUDA graph replays alike).
        per_owner: add per-owner quantizer keys (``fp8state/scale/<owner>``, ...).
        per_expert: add per-expert keys for the model's mixture-of-experts layers (tokens per
            expert and idle experts per step, scales and amaxes by expert on log steps;
            :mod:`~lightning_fp8state.telemetry.experts`). Under data parallelism the tokens
            and idle experts written are sums over the ranks (one all-reduce per window, which
            every rank runs: keep ``per_expert`` the same on all ranks).
        sinks: more sinks (Lightning loggers, :class:`WandbSink`); the JSONL is always there.
        write: whether this process writes (False on ranks other than 0: it still guards).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        model: nn.Module | None = None,
        state=None,
        log_every: int = 50,
        guard: bool = True,
        max_grad_norm: float | None = None,
        clip_algorithm: str = "norm",
        apply_clipping: bool | None = None,
        dominant_by: str = "layer",
        saturation: bool = True,
        per_owner: bool = True,
        per_expert: bool = True,
        sinks: Iterable[Sink] = (),
        jsonl_name: str = JSONL_NAME,
        write: bool = True,
    ) -> None:
        require_int("log_every", log_every, 1)
        require_choice("clip_algorithm", clip_algorithm, CLIP_ALGORITHMS)
        require_choice("dominant_by", dominant_by, SOURCE_GROUPINGS)
        require_number("max_grad_norm", max_grad_norm, 0, low_open=True, optional=True)
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / jsonl_name
        self.model = model
        self.protocol = getattr(state, "protocol", state) if state is not None else find_protocol(model)
        self.log_every = log_every
        self.guard = guard
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.clip_algorithm = clip_algorithm
        self.apply_clipping = (max_grad_norm is not None) if apply_clipping is None else bool(apply_clipping)
        self.dominant_by = dominant_by
        self.per_owner = per_owner
        self.write = write
        self.sink = FanOut([JsonlSink(self.jsonl_path), *sinks] if write else [])
        self.recorder = StepRecorder()
        self.saturation = None
        if saturation and self.protocol is not None and self.protocol.recipe.quantized:
            self.saturation = SaturationWindow()
        self.experts = ExpertTelemetry.attach(model) if per_expert else None
        # cumulative counters (host)
        self.attempted = self.applied = self.skipped = 0
        self.nonfinite = self.clip_events = 0
        self.engine_skipped_steps: int | None = None
        self.last_row: dict[str, Any] | None = None
        # per step / per window
        self._pending: _Pending | None = None
        self._loss: torch.Tensor | None = None
        self._tokens = 0
        self._tokens_seen = False
        self._names: dict[int, str] | None = None
        self._sources_key: tuple | None = None
        self._sources: tuple[list[str], torch.Tensor] | None = None
        self._after_event = None
        # this window's steps: [applied (a bool, or the device's flag until resolved), tokens]
        self._outcomes: list[list] = []
        self._counted = 0  # outcomes already in the cumulative counters
        self.reset_window()

    # -- the window --------------------------------------------------------------------
    def reset_window(self) -> None:
        """Start a new throughput window now (e.g. when training starts after setup). Steps
        recorded so far keep their rows and count in the cumulative counters, not in the window."""
        self._resolve()
        self._win_start = time.perf_counter()
        self._win_steps = self._win_applied = 0
        self._win_tokens = self._win_eff_tokens = 0

    def _resolve(self) -> None:
        """Count the window's steps not counted yet; the device's decisions among them move to
        the host in one transfer (log steps, checkpoints: never between them)."""
        todo = self._outcomes[self._counted :]
        flags = [o for o in todo if isinstance(o[0], torch.Tensor)]
        if flags:
            vals = [o[0].detach().reshape(()).to(torch.float64) for o in flags]
            if any(v.device != vals[0].device for v in vals):
                vals = [v.cpu() for v in vals]
            values = torch.stack(vals).tolist()
            for o, v in zip(flags, values, strict=True):
                o[0] = v == 1.0
        for applied, tokens in todo:
            self.applied += applied
            self.skipped += not applied
            self._win_applied += applied
            self._win_eff_tokens += tokens if applied else 0
        self._counted = len(self._outcomes)

    @property
    def step_pending(self) -> bool:
        """Whether a step was measured (:meth:`before_optimizer_step`) and not yet counted."""
        return self._pending is not None

    # -- observations ------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        """Add a loss that is backpropagated in this optimizer step (device work only)."""
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss

    def observe_tokens(self, tokens: int) -> None:
        """Add the tokens processed in this optimizer step (a host number)."""
        self._tokens += int(tokens)
        self._tokens_seen = True

    def _param_names(self) -> dict[int, str]:
        if self._names is None:
            self._names = {} if self.model is None else {id(p): n for n, p in self.model.named_parameters()}
        return self._names

    def _source_index(self, optimizer, params: list[torch.Tensor], device) -> tuple[list[str], torch.Tensor]:
        key = tuple(map(id, params))
        if key != self._sources_key:
            names = self._param_names()
            order = {
                id(p): f"group{g}.param{i}"
                for g, grp in enumerate(optimizer.param_groups)
                for i, p in enumerate(grp["params"])
            }
            labels = [names.get(id(p)) or order.get(id(p), "?") for p in params]
            sources, index = source_groups(labels, self.dominant_by)
            self._sources = (sources, torch.tensor(index, dtype=torch.long, device=device))
            self._sources_key = key
        return self._sources

    # -- the step ----------------------------------------------------------------------
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, *, loss=None, tokens=None) -> bool:
        """Measure the gradients about to be applied and decide whether to apply them.

        Call after backward (and before clipping: the norm reported is the one before).
        When the guard is on, a step with a gradient element that is not finite is skipped:
        with a fused optimizer (:func:`skips_on_device`) its ``found_inf`` flag is set on the
        device and its ``step()`` skips itself, with no host read; with any other optimizer
        the flag is read on the host, every gradient of its parameters is set to ``None`` (so
        an ``optimizer.step()`` that runs anyway changes neither parameters nor optimizer
        state) and ``False`` is returned.

        Returns:
            Whether to run ``optimizer.step()`` (``True`` when the optimizer decides itself).
        """
        if self._pending is not None:  # a previous step was never finished (several optimizers)
            self.after_optimizer_step()
        if loss is not None:
            self.observe_loss(loss)
        if tokens is not None:
            self.observe_tokens(tokens)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device: dict[str, torch.Tensor] = {}
        host: dict[str, Any] = {}
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        if isinstance(lr, torch.Tensor):
            device["train/lr"] = lr
        elif lr is not None:
            host["train/lr"] = float(lr)
        if self._loss is not None:
            device.update({f"train/{k}": v for k, v in loss_summary(self._loss).items()})
        apply: bool | torch.Tensor = True
        flagged = None
        if params:
            grads = [p.grad for p in params]
            norms = gradient_norms(grads)
            sources, index = self._source_index(optimizer, params, norms.device)
            summary = gradient_summary(norms, index, len(sources))
            device["train/grad_norm"] = summary["grad_norm"]
            device["train/grad_finite"] = summary["grad_finite"]
            device["train/dominant_grad_share"] = summary["dominant_share"]
            device["train/dominant_grad_index"] = summary["dominant_index"]
            host[_SOURCES] = sources
            if self.max_grad_norm is not None:
                max_abs = None
                if self.clip_algorithm == "value":
                    max_abs = gradient_norms(grads, math.inf).max()
                device["train/clipped"] = clip_event(
                    summary["grad_norm"], max_abs, self.max_grad_norm, self.clip_algorithm
                )
            if self.guard and skips_on_device(optimizer, params):
                apply = summary["grad_finite"]  # decided on the device: the optimizer reads the flag
                optimizer.found_inf = (apply == 0).to(torch.float32)
                flagged = optimizer
            elif self.guard:
                apply = bool(summary["grad_finite"])  # the guard's one host sync per step
                if not apply:
                    for p in params:
                        p.grad = None
            # a step the device may skip is clipped anyway (its gradients are then not used)
            if apply is not False and self.apply_clipping and self.max_grad_norm is not None:
                targets = _clip_targets(params, grads)
                if self.clip_algorithm == "norm":
                    torch.nn.utils.clip_grads_with_norm_(targets, self.max_grad_norm, summary["grad_norm"].float())
                else:
                    torch.nn.utils.clip_grad_value_(targets, self.max_grad_norm)
        self._pending = _Pending(device, host, apply, flagged)
        return apply is not False

    def after_optimizer_step(self, *, step: int | None = None, engine=None) -> dict[str, Any] | None:
        """Count the step and, on a log step, write the window. Returns the log step's row.

        Args:
            step: the step number for the row (default: steps attempted so far).
            engine: a DeepSpeed engine: its own skipped steps (fp16 loss scaling) are read
                and counted as skipped, and its loss scale is reported.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            pending = _Pending({}, {}, True)
        device, host = pending.device, pending.host
        engine_skipped = False
        info = read_engine_step(engine) if engine is not None else None
        if info is not None:
            before = self.engine_skipped_steps
            if before is None:
                before = 0
            engine_skipped = info.skipped_steps > before
            self.engine_skipped_steps = info.skipped_steps
            host["train/steps_skipped_loss_scale"] = info.skipped_steps
            if info.loss_scale is not None:
                host["train/loss_scale"] = info.loss_scale
            if info.grad_norm is not None and "train/grad_norm" not in device:
                if isinstance(info.grad_norm, torch.Tensor):
                    device["train/grad_norm"] = info.grad_norm
                else:
                    host["train/grad_norm"] = info.grad_norm
        opt = pending.flagged
        if opt is not None and getattr(opt, "found_inf", None) is not None:
            del opt.found_inf  # ours, for the step just taken: a later step() must not read it
        applied = False if engine_skipped else pending.guard_applied
        if info is not None and info.found_inf is not None:
            # the engine's device guard (lightning.deepspeed_guard) skipped the step or not:
            # a device flag, read with the window on the log step
            setattr(engine, FOUND_INF_ATTR, None)  # this step's flag only
            if applied is not False:
                device_applied = info.found_inf.reshape(()) == 0
                applied = device_applied if applied is True else applied.reshape(()) * device_applied
        self.attempted += 1
        tokens = self._tokens
        self._win_steps += 1
        self._win_tokens += tokens
        self._outcomes.append([applied, tokens])
        if not isinstance(applied, torch.Tensor):
            self._resolve()  # a host decision: counted now
        host.update({"step": self.attempted if step is None else int(step), "time": time.time()})
        if self._tokens_seen:
            host["train/tokens"] = tokens
        if self.experts is not None:  # every rank: the count restarts with the step
            host.update(self.experts.take_step())
        if self.write:
            self.recorder.append(device, host)
        self._loss, self._tokens = None, 0
        row = self.flush() if self.attempted % self.log_every == 0 else None
        return row

    def flush(self) -> dict[str, Any] | None:
        """Move the window to the host, add window aggregates and quantizer health to its
        last row, write every row to the sinks. Returns that last row (``None`` if empty)."""
        if self._pending is not None:  # a measured step that was never finished: finish it
            row = self.after_optimizer_step()
            if row is not None:
                return row
        self._resolve()
        rows = self.recorder.drain()  # the one device-to-host transfer of the window
        if self.experts is not None:  # every rank, each window: the counts summed over the ranks
            # (not while an exception is handled: the other ranks may never join the collective)
            self.experts.reduce_window(rows, across_ranks=sys.exc_info()[0] is None)
        elapsed = max(time.perf_counter() - self._win_start, 1e-9)
        window = (self._win_steps, self._win_applied, self._win_tokens, self._win_eff_tokens)
        # each row's cumulative counts: the totals less what the window's later steps added
        outcomes = self._outcomes
        applied = self.applied - sum(bool(a) for a, _ in outcomes)
        skipped = self.skipped - sum(not a for a, _ in outcomes)
        attempted = self.attempted - len(outcomes)
        for row, (ok, _) in zip(rows, outcomes if rows else [], strict=True):  # one row per step
            attempted, applied, skipped = attempted + 1, applied + ok, skipped + (not ok)
            row["train/skipped"] = float(not ok)
            row["train/steps_attempted"] = attempted
            row["train/steps_applied"] = applied
            row["train/steps_skipped"] = skipped
        self._outcomes, self._counted = [], 0
        self.reset_window()
        if not rows:
            return None
        for row in rows:
            sources = row.pop(_SOURCES, None)
            index = row.pop("train/dominant_grad_index", None)  # meaningful only with its name list
            if sources is not None and index is not None and math.isfinite(index):
                row["train/dominant_grad_source"] = sources[int(index)]
            if row.get("train/grad_finite", 1.0) == 0.0:
                self.nonfinite += 1
            self.clip_events += row.get("train/clipped", 0.0) == 1.0
            row["train/steps_nonfinite"] = self.nonfinite
            row["train/clip_events"] = self.clip_events
        last = rows[-1]
        steps, applied, tokens, eff_tokens = window
        last["train/window_steps"] = steps
        last["train/steps_applied_window"] = applied
        last["train/steps_skipped_window"] = steps - applied
        last["train/window_seconds"] = elapsed
        last["train/steps_per_s"] = steps / elapsed
        last["train/effective_steps_per_s"] = applied / elapsed
        if self._tokens_seen:
            last["train/tokens_per_s"] = tokens / elapsed
            last["train/effective_tokens_per_s"] = eff_tokens / elapsed
        last.update(device_memory(self._model_device()))
        if self.protocol is not None:
            health, self._after_event = quantizer_health(
                self.protocol, saturation=self.saturation, after_event=self._after_event, per_owner=self.per_owner
            )
            last.update(health)
            if self.experts is not None:
                last.update(self.experts.health(self.protocol))
        self.sink.write(rows)
        self.last_row = last
        return last

    def _model_device(self) -> torch.device | None:
        """The device of the model's first parameter (its memory is logged), if any."""
        if isinstance(self.model, nn.Module):
            for p in self.model.parameters():
                return p.device
        return None

    def checkpoint(self) -> None:
        """Write the rows measured so far and put them on the disk: called when a checkpoint is
        saved, so that a kill after it loses no row of a step that a resume will not re-run."""
        self.flush()
        self.sink.sync()

    def close(self) -> None:
        """Write what is left of the window and close the sinks. A sink that
        failed during the run is summed up once more here (a warning per sink)."""
        self.flush()
        self.sink.close()
        for line in self.sink.failure_report():
            warnings.warn(f"end of run: {line}", RuntimeWarning, stacklevel=2)
        if self.experts is not None:
            self.experts.close()
            self.experts = None

    # -- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, int | None]:
        """The cumulative counters (plain numbers), so a resumed run keeps counting."""
        self._resolve()
        return {
            "attempted": self.attempted,
            "applied": self.applied,
            "skipped": self.skipped,
            "nonfinite": self.nonfinite,
            "clip_events": self.clip_events,
            "engine_skipped_steps": self.engine_skipped_steps,
        }

    def load_state_dict(self, sd: Mapping[str, int | None]) -> None:
        for key in ("attempted", "applied", "skipped", "nonfinite", "clip_events"):
            setattr(self, key, int(sd.get(key, 0)))
        skipped = sd.get("engine_skipped_steps")
        self.engine_skipped_steps = None if skipped is None else int(skipped)
