"""Fp8State: the public facade — convert a model, run logical events, save and load state."""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import nn

from .config import QuantConfig
from .errors import StateLoadError, StateTransitionError
from .nn import ConversionReport, convert_model
from .protocol import QuantProtocol
from .state import Ledger, LogicalClock, StateBank

__all__ = ["STATE_FORMAT_VERSION", "Fp8State"]

# 2 added FP4 owners (format names nvfp4/mxfp4), the running centers and the attn_* config
# fields; format 1 (FP8 only) still loads.
STATE_FORMAT_VERSION = 2
_LOADABLE_VERSIONS = (1, 2)
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


class Fp8State(QuantProtocol):
    """Owns the state bank, logical clock, ledger and snapshot stash of one process.

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

    def __init__(self, config: QuantConfig | None = None, *, rank: int = 0) -> None:
        super().__init__(config if config is not None else QuantConfig(), rank=rank)
        self.last_conversion: ConversionReport | None = None
        # Layers (and FP4 attention quantizers) of every model converted by this state.
        self.converted_layers: set[str] = set()
        # Layers of a state loaded before any model was converted: the first convert() checks
        # that its model has them (else the loaded state belonged to another model).
        self._loaded_unchecked: set[str] | None = None

    @property
    def protocol(self) -> QuantProtocol:
        return self

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap matching ``nn.Linear`` layers of ``model`` (in place), bind its unbound
        ``Fp4AttentionQuantizer`` modules, and return it.

        The report of converted and skipped layers is kept in :attr:`last_conversion`.
        """
        report = convert_model(model, self)
        self.last_conversion = report
        self.converted_layers.update(report.converted, report.attention)
        if self._loaded_unchecked is not None:
            unknown, self._loaded_unchecked = sorted(self._loaded_unchecked - self.converted_layers), None
            if unknown:
                self._reset_state()
                raise StateLoadError(
                    "the quantizer state loaded before convert() belongs to a different model: it holds state "
                    f"for layers {_few(unknown)} that this model does not have (converted here: "
                    f"{_few(sorted(self.converted_layers))}). The loaded state was discarded; load a state "
                    "saved from this model (convert first, then load: a mismatch is refused before anything changes)"
                )
        return model

    def _reset_state(self) -> None:
        self.bank = StateBank(self.config.history_len)
        self.clock = LogicalClock()
        self.ledger = Ledger(strict=self.config.strict, window=self.config.ledger_window)

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
        }

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
            if last is not None and (len(last) != 2 or any(int(v) < 0 for v in last)):
                raise ValueError(last)
            ledger_sd = sd["ledger"]
            if not (len(ledger_sd["owners"]) == len(ledger_sd["commits"]) == len(ledger_sd["observations"])):
                raise ValueError("ledger lengths differ")
        except (KeyError, TypeError, ValueError) as exc:
            raise StateLoadError(f"saved quantizer state is corrupt: clock or ledger ({exc!r})") from exc
        owners, _, _ = StateBank.validate_state_dict(sd["bank"], self.bank.history_len)
        saved_layers = {o.layer for o in owners} - {"*"}
        fresh = len(self.bank) == 0
        if fresh and self.converted_layers:
            unknown = sorted(saved_layers - self.converted_layers)
            if unknown:
                raise StateLoadError(
                    "saved quantizer state belongs to a different model: it holds state for layers "
                    f"{_few(unknown)} that this model does not have (converted here: "
                    f"{_few(sorted(self.converted_layers))})"
                )
        self.bank.load_state_dict(sd["bank"])  # validates fully before changing anything
        self._loaded_unchecked = saved_layers if fresh and not self.converted_layers else None
        self.clock.load_state_dict(sd["clock"])
        self.ledger.load_state_dict(sd["ledger"])
