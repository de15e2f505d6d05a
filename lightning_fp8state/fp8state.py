"""Fp8State: the public facade — convert a model, run logical events, save and load state."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import fields

import torch
from torch import nn

from .config import QuantConfig, require_choice, require_type
from .defects import policy_for
from .errors import ConversionWarning, StateLoadError, StateTransitionError
from .nn import ConversionReport, convert_model
from .protocol import QuantProtocol
from .protocol.fallback import FallbackMonitor
from .recompute import ENGINES, bind_event_engine, unbind_event_engine
from .state import StateBank

__all__ = ["STATE_FORMAT_VERSION", "Fp8State"]

# 2 added FP4 owners (format names nvfp4/mxfp4), the running centers and the attn_* config
# fields; format 1 (FP8 only) still loads. 3 added "fallback" (QuantConfig.fallback: the layers
# moved to high precision, with step and reason); formats 1 and 2 load as "no layer moved".
STATE_FORMAT_VERSION = 3
_LOADABLE_VERSIONS = (1, 2, 3)
# Config fields that change the meaning of saved state: a checkpoint must agree on them.
_STATE_DEFINING = (
    "recipe",
    "history_len",
    "amax_algo",
    "margin",
    "ownership",
    "forward_format",
    "backward_format",
    "attn_format",
    "attn_centered",
    "attn_center_momentum",
)
# Fields a format-1 checkpoint could not record: it was made with their defaults.
_ADDED_IN_V2 = ("attn_format", "attn_centered", "attn_center_momentum")
_DEFAULTS = {f.name: f.default for f in fields(QuantConfig)}


def _few(names: list[str], n: int = 5) -> str:
    return f"{names[:n]}{' ...' if len(names) > n else ''}"


class Fp8State:
    """The public facade: converts a model, runs logical events, saves and loads state.

    It holds the process's :class:`~lightning_fp8state.protocol.QuantProtocol` (bank, clock,
    ledger, snapshot stash, guard) with the quantize policy that ``config.mode`` names.

    Example::

        state = Fp8State(QuantConfig())
        model = state.convert(model)
        for step in range(n):
            with state.step(step, microbatch=0):
                y = lightning_fp8state.checkpoint(block, x)
                loss = y.float().pow(2).mean()
                state.commit_forward()
                loss.backward()
    """

    def __init__(self, config: QuantConfig | None = None, *, rank: int = 0, checkpoint_engine: str = "torch") -> None:
        """
        Args:
            config: the quantization configuration (default: ``QuantConfig()``).
            rank: this process's rank (part of every owner's key under per_layer_rank*).
            checkpoint_engine: what ``lightning_fp8state.checkpoint(fn, *args)`` runs when it
                names no engine, while an event of this state is open: ``"torch"`` or
                ``"deepspeed"`` (the fp8state_deepspeed strategy sets it on the callback's
                state when DeepSpeed's activation checkpointing features are on).
        """
        config = config if config is not None else QuantConfig()
        require_type("config", config, QuantConfig, "a QuantConfig")
        self._protocol = QuantProtocol(config, rank=rank, policy=policy_for(config.mode))
        self.last_conversion: ConversionReport | None = None
        self.checkpoint_engine = checkpoint_engine
        self._engine_binding = None
        # every layer converted so far, checked for owners after the next event (once)
        self.conversion = ConversionReport()
        self._check_owners = False
        self._conversion_warned: set[str] = set()  # convert()'s warnings, each said once
        # Layers (and FP4 attention quantizers) of every model converted by this state.
        self.converted_layers: set[str] = set()
        # Layers of a state loaded before any model was converted: the first convert() checks
        # that its model has them (else the loaded state belonged to another model).
        self._loaded_unchecked: tuple | None = None  # (saved owner layers, saved converted layers)

    # -- what it holds (read access; the protocol's internals stay behind .protocol) ---
    @property
    def protocol(self) -> QuantProtocol:
        """The rules engine the converted modules call (internal: modules, audit, telemetry)."""
        return self._protocol

    @property
    def config(self) -> QuantConfig:
        return self._protocol.config

    @property
    def rank(self) -> int:
        return self._protocol.rank

    @property
    def bank(self):
        """The :class:`~lightning_fp8state.state.StateBank` of every owner's delayed state."""
        return self._protocol.bank

    @property
    def clock(self):
        """The :class:`~lightning_fp8state.state.LogicalClock` (which event is open, the last one)."""
        return self._protocol.clock

    @property
    def ledger(self):
        """The :class:`~lightning_fp8state.state.Ledger`: observations and commits per owner."""
        return self._protocol.ledger

    @property
    def event(self):
        """The open logical event ``(step, microbatch)``, or ``None``."""
        return self._protocol.event

    @property
    def checkpoint_engine(self) -> str:
        """The engine of unnamed ``checkpoint()`` calls inside this state's events."""
        return self._checkpoint_engine

    @checkpoint_engine.setter
    def checkpoint_engine(self, engine: str) -> None:
        require_choice("checkpoint_engine", engine, ENGINES)
        self._checkpoint_engine = engine

    # -- events: the checkpoint engine is bound while one is open ------------------
    @contextlib.contextmanager
    def step(self, step: int | None = None, microbatch: int = 0):
        """One logical event (one microbatch's forward + backward).

        On a clean exit, every observed owner not yet committed is committed, the ledger
        is checked and the stash released. If the body raises, the event is aborted:
        pending amaxes are discarded, nothing further commits, and the error propagates.
        """
        self.begin_event(step, microbatch)
        try:
            yield self
        except BaseException:
            self.abort_event()
            raise
        self.end_event()

    def begin_event(self, step: int | None = None, microbatch: int = 0):
        event = self._protocol.begin_event(step, microbatch)
        self._engine_binding = bind_event_engine(self._checkpoint_engine)
        return event

    def commit_forward(self) -> None:
        """Advance the forward roles (input, weight, attention operands) observed so far."""
        self._protocol.commit_forward()

    def end_event(self) -> None:
        """Commit what is left (backward roles, or all if commit_forward was not called)."""
        try:
            self._protocol.end_event()
        finally:
            self._unbind_engine()
        if self._check_owners:
            self._check_owners = False
            self.warn_unowned()

    def abort_event(self) -> None:
        """Close the open event without committing; its pending amaxes are discarded."""
        try:
            self._protocol.abort_event()
        finally:
            self._unbind_engine()

    def _unbind_engine(self) -> None:
        if self._engine_binding is not None and self.clock.event is None:
            unbind_event_engine(self._engine_binding)
            self._engine_binding = None

    def enable_amax_reduction(self, *, group=None, device: torch.device | None = None) -> bool:
        """Reduce pending amaxes across the data-parallel ``group`` before every commit (see
        :meth:`QuantProtocol.enable_amax_reduction`); returns whether it is on."""
        return self._protocol.enable_amax_reduction(group=group, device=device)

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap matching ``nn.Linear`` layers of ``model`` (in place), bind its unbound
        ``Fp4AttentionQuantizer`` modules, and return it.

        The report of this call (converted, skipped and not-quantizable candidates, each with a
        reason) is kept in :attr:`last_conversion`; :attr:`conversion` accumulates every call's.
        After the next event, a converted layer that never ran through the protocol (no owner
        in the bank) is warned about once (:class:`ConversionWarning`). What the conversion
        itself warns about (a pattern that matched no module, nothing converted) is said once
        per state, not again at a second convert of the same model.
        """
        report = convert_model(model, self._protocol, warn=False)
        for message in report.warnings:
            if message not in self._conversion_warned:
                self._conversion_warned.add(message)
                warnings.warn(message, ConversionWarning, stacklevel=2)
        self.last_conversion = report
        self.conversion.merge(report)
        # a second convert with nothing new (the Lightning callback converts at setup and again at
        # fit start) must not cancel the check a first one armed
        self._check_owners = self._check_owners or bool(report.converted or report.attention)
        self.converted_layers.update(report.layers())  # the layer names their owners take
        if self._loaded_unchecked is not None:
            saved, self._loaded_unchecked = self._loaded_unchecked, None
            problem = self._owner_mismatch(*saved)
            if problem:
                self._protocol.reset()
                raise StateLoadError(
                    f"the quantizer state loaded before convert() belongs to a different model: {problem}. "
                    "The loaded state was discarded; load a state saved from this model (convert first, then "
                    "load: a mismatch is refused before anything changes)"
                )
        return model

    def _owner_mismatch(self, saved_layers: set[str], saved_converted: set[str] | None = None) -> str | None:
        """Why a saved state's owner layers do not fit the converted model (None when they do):
        layers the model lacks, or converted layers the saved model did not have. The saved
        model's converted layers (``saved_converted``, recorded since the state carries them)
        decide the second: a layer that had not run by the save (a head used some steps, the
        parts of a packed projection a self-attention does not split) has no owner yet, and is
        no mismatch. A state saved before its first event (no owners) fits any model."""
        if not saved_layers or not self.converted_layers:
            return None
        unknown = sorted(saved_layers - self.converted_layers)
        missing = sorted(self.converted_layers - (saved_layers if saved_converted is None else saved_converted))
        if unknown:
            return (
                f"it holds state for layers {_few(unknown)} that this model does not have (converted here: "
                f"{_few(sorted(self.converted_layers))})"
            )
        if missing:
            return (
                f"it holds no state for the converted layers {_few(missing)} (saved: {_few(sorted(saved_layers))}); "
                "a model with more layers than the one it was saved from"
            )
        return None

    def warn_unowned(self) -> list[str]:
        """Warn about converted layers that hold no quantizer owner: they never ran a training
        forward through the protocol (not called in the event, or their weight is used outside
        their forward, so they are not quantized at all). Returns their names. Checked once
        after the first event following :meth:`convert`; under the bf16 recipe or the per_model
        scope (no per-layer owners) nothing is checked."""
        if not self.protocol.recipe.quantized or self.config.ownership == "per_model":
            return []
        unowned = self.conversion.unowned(self)
        if unowned:
            shown = ", ".join(unowned[:8]) + (f" ... ({len(unowned)} in all)" if len(unowned) > 8 else "")
            warnings.warn(
                f"lightning_fp8state: {len(unowned)} converted layer(s) never ran through the quantizer in "
                f"the first event: {shown}. A layer called only in some steps is fine; one whose weight is "
                "used outside its own forward (read by a parent module, tied into another op) is not quantized "
                "at all: exclude it (QuantConfig.exclude) so the report does not claim it",
                ConversionWarning,
                stacklevel=2,
            )
        return unowned

    def nonfinite_counts(self) -> dict:
        """Per owner: how many events had a non-finite amax (skipped, not committed).

        Reads device memory (a host sync): for logging steps and tests, not the hot path.
        """
        counts = self.bank.nonfinite_count.cpu().tolist()
        return {o: c for o, c in zip(self.bank.owners, counts, strict=False)}

    def scale_of(self, owner) -> torch.Tensor:
        """The live scale of ``owner`` (a view: it changes at the owner's next commit)."""
        return self.bank.scale[self.bank.index[owner]]

    # -- checkpoint ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Bank, clock and ledger as tensors and plain values (``weights_only``-loadable)."""
        if self.clock.event is not None:
            raise StateTransitionError(
                f"state_dict() inside event {self.clock.event}: save between events, never mid-event"
            )
        return {
            "format_version": STATE_FORMAT_VERSION,
            "config": {k: getattr(self.config, k) for k in _STATE_DEFINING},
            "rank": self.rank,
            "bank": self.bank.state_dict(),
            "clock": self.clock.state_dict(),
            "ledger": self.ledger.state_dict(),
            # the model's converted layers: those that have not run yet own nothing in the bank
            "converted_layers": sorted(self.converted_layers),
            # the fallback's moves (empty when it is off): a resumed run keeps those layers moved
            "fallback": self._fallback_state(),
        }

    def _fallback_state(self) -> dict:
        monitor = self._protocol.fallback
        return monitor.state_dict() if monitor is not None else {"events": [], "streaks": {}, "layers": []}

    @staticmethod
    def remap_rank(state_dict: dict, rank: int) -> dict:
        """A copy of a saved state re-keyed from its rank to ``rank``.

        For read-only use of one rank's state on another (evaluating a checkpoint with a
        different world size): owner keys carry the rank only under the per_layer_rank*
        ownership scopes, and only those are rewritten. Training on from a remapped state
        is not an exact resume: the histories belong to another rank's data.

        Raises:
            StateLoadError: ``state_dict`` is not a saved Fp8State.
        """
        try:
            scope = state_dict["config"]["ownership"]
            out = dict(state_dict, rank=int(rank))
            if scope in ("per_layer_rank", "per_layer_rank_stream"):
                for part in ("bank", "ledger"):
                    owners = [[o[0], o[1], int(rank), *o[3:]] for o in state_dict[part]["owners"]]
                    out[part] = dict(state_dict[part], owners=owners)
        except (KeyError, TypeError, IndexError) as exc:
            raise StateLoadError(f"not an Fp8State state dict: cannot remap its rank ({exc!r})") from exc
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a saved state; every check runs before anything is changed.

        Raises:
            StateLoadError: the state is corrupt, of another format version, or belongs to
                a differently configured run, another rank or another model. The live
                state is left untouched.
        """
        if self.clock.event is not None:
            raise StateTransitionError(f"load_state_dict() inside event {self.clock.event}: load between events")
        sd = state_dict
        if not isinstance(sd, dict) or "format_version" not in sd:
            raise StateLoadError("not an Fp8State state dict: 'format_version' is missing")
        version = sd["format_version"]
        if version not in _LOADABLE_VERSIONS:
            raise StateLoadError(
                f"state format_version {version!r} is not supported: expected one of {list(_LOADABLE_VERSIONS)}"
            )
        for key in ("config", "rank", "bank", "clock", "ledger"):
            if key not in sd:
                raise StateLoadError(f"saved quantizer state is corrupt: '{key}' is missing")
        if version >= 2 and isinstance(sd["bank"], dict) and "center_width" not in sd["bank"]:
            raise StateLoadError("saved quantizer state is corrupt: format 2 bank without 'center_width'")
        saved_cfg = dict(sd["config"])
        if version == 1:
            for key in _ADDED_IN_V2:
                saved_cfg.setdefault(key, _DEFAULTS[key])
        saved_recipe = saved_cfg.get("recipe")
        if saved_recipe != self.config.recipe:
            raise StateLoadError(
                f"saved quantizer state was made with recipe {saved_recipe!r}, this run uses recipe "
                f"{self.config.recipe!r}: resume with quant.recipe={saved_recipe}, or start a new run"
            )
        diff = {
            k: (saved_cfg.get(k), getattr(self.config, k))
            for k in _STATE_DEFINING
            if saved_cfg.get(k) != getattr(self.config, k)
        }
        if diff:
            detail = ", ".join(f"{k}: saved {a!r}, live {b!r}" for k, (a, b) in diff.items())
            raise StateLoadError(f"saved quantizer state was made with another configuration ({detail})")
        if sd["rank"] != self.rank:
            raise StateLoadError(f"saved quantizer state belongs to rank {sd['rank']}, this is rank {self.rank}")
        try:
            last = sd["clock"]["last"]
            clock_ok = last is None or (len(last) == 2 and all(int(v) >= 0 for v in last))
            ledger_sd = sd["ledger"]
            ledger_ok = len(ledger_sd["owners"]) == len(ledger_sd["commits"]) == len(ledger_sd["observations"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StateLoadError(f"saved quantizer state is corrupt: clock or ledger ({exc!r})") from exc
        if not (clock_ok and ledger_ok):
            what = f"the clock's last event {last!r}" if not clock_ok else "the ledger's lists differ in length"
            raise StateLoadError(f"saved quantizer state is corrupt: clock or ledger ({what})")
        owners, _, _ = StateBank.validate_state_dict(sd["bank"], self.bank.history_len)
        fallback = self._check_fallback(sd, version)
        saved_layers = {o.layer for o in owners} - {"*"}
        saved_converted = sd.get("converted_layers")
        if saved_converted is not None:
            if not isinstance(saved_converted, (list, tuple)) or not all(isinstance(n, str) for n in saved_converted):
                raise StateLoadError("saved quantizer state is corrupt: 'converted_layers' is not a list of names")
            saved_converted = set(saved_converted)
        fresh = len(self.bank) == 0
        per_layer = self.config.ownership != "per_model"
        problem = self._owner_mismatch(saved_layers, saved_converted) if per_layer else None
        if problem:
            raise StateLoadError(f"saved quantizer state belongs to a different model: {problem}")
        self.bank.load_state_dict(sd["bank"])  # validates fully before changing anything
        self._loaded_unchecked = (saved_layers, saved_converted) if fresh and not self.converted_layers else None
        self.clock.load_state_dict(sd["clock"])
        self.ledger.load_state_dict(sd["ledger"])
        if self._protocol.fallback is not None:
            self._protocol.fallback.load_state_dict(fallback)

    def _check_fallback(self, sd: dict, version: int) -> dict:
        """The saved fallback state, checked (formats 1 and 2: none moved).

        Raises:
            StateLoadError: missing from a format-3 state, corrupt, or naming moved layers while
                this run has the fallback off (they would silently go back to FP8).
        """
        empty = {"events": [], "streaks": {}, "layers": []}
        if version < 3:
            return empty
        if "fallback" not in sd:
            raise StateLoadError("saved quantizer state is corrupt: format 3 without 'fallback'")
        events = FallbackMonitor.validate_state_dict(sd["fallback"])
        if events and self._protocol.fallback is None:
            layers = sorted({e.layer for e in events})
            raise StateLoadError(
                f"saved quantizer state moved layers {_few(layers)} to high precision (QuantConfig.fallback), "
                "but this run has the fallback off: resume with quant.fallback=true"
            )
        return sd["fallback"]
