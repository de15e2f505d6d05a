"""Quantize one operand of a call: which snapshot it uses, and whether it records (rules 3-5).

:class:`Quantizer` decides, per phase, how a role's tensor of a call is encoded: a true
forward records its amax into the owner's pending slot (and the owner is observed); a
recompute re-encodes with the true forward's snapshot through the same op, its statistics
folded into a scratch slot nobody reads (read-only); outside an event a copy of the live
state is used. *How* a role's tensor is encoded is its encoder's (the recipe's); a stateless
role derives its scale from the tensor itself. A quantize policy, where one was handed in,
replaces the rules for true-forward and recompute calls.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..encoders import Prologue
from ..errors import StaleSnapshotError, StateTransitionError
from ..recompute import CallRecord, Phase
from ..sac import in_selective_checkpoint, outside_selective_checkpoint
from ..state import FORWARD_ROLES, Event, QuantSnapshot, role_phase
from .events import require_open
from .policy import PolicyPort

__all__ = ["Quantizer", "release_weight_codes"]

# CallRecord.derived's key for the weight's codes of a call's true forward (its recompute reuses them)
_CODES = "weight_codes"


def _parameter_key(x: torch.Tensor) -> tuple:
    """What identifies a parameter's contents inside an event: its memory, layout and version
    (an in-place update bumps the version; a view, e.g. Conv1D's transposed weight, shares it)."""
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x._version)


def release_weight_codes(record: CallRecord) -> None:
    """Drop the weight codes ``record``'s true forward kept for its recompute (the call's
    backward, after which no recompute of it runs in the event, calls this)."""
    record.derived.pop(_CODES, None)


class _Scratch(NamedTuple):
    """Where recompute's quantize records to (read by no one): the bank's statistics' shape."""

    amax_pending: torch.Tensor
    center_max: torch.Tensor
    center_min: torch.Tensor
    saturation: torch.Tensor  # [2, 1] int64: the clip counts recompute adds (nobody reads them)


class Quantizer:
    """Encodes a call's operands for a protocol, by the rules or by its quantize policy."""

    def __init__(self, protocol, records, commits, policy=None) -> None:
        """
        Args:
            protocol: the :class:`~lightning_fp8state.protocol.QuantProtocol` whose bank, ledger
                and open event it reads (each may be replaced: read per use).
            records: its :class:`~lightning_fp8state.protocol.records.CallRecords` (the
                stateless owners' latest snapshots are noted there).
            commits: its :class:`~lightning_fp8state.protocol.events.Commits` (a policy's
                ``commit_now``).
            policy: ``None`` (the rules), or a quantize policy that replaces them for
                true-forward and recompute calls.
        """
        config = protocol.config
        self._protocol = protocol
        self._records = records
        self._config = config
        self._recipe = protocol.recipe
        self._lock = protocol._lock
        self._guard = protocol.guard
        self._stream_order = protocol.stream_order
        self._encoders = protocol._encoders  # role -> encoder, filled by protocol.encoder
        self._encoder = protocol.encoder
        self._stream_scoped = config.ownership == "per_layer_rank_stream"  # the guard's error hint
        # layers whose true forward keeps no weight codes for the recompute (sharded.py says why)
        self._codes_not_kept = protocol.sharded_layers
        self._policy = policy
        self._port = None if policy is None else PolicyPort(protocol, self, records, commits)
        self.scratch: dict[tuple, _Scratch] = {}  # (device, center width) -> recompute's scratch slot

    # -- the rules -------------------------------------------------------------------
    def quantize(self, record: CallRecord, role: str, x: torch.Tensor, phase: Phase, prologue=None):
        """``(data, snapshot)`` of ``role``'s operand ``x`` in ``record``'s call (see
        :meth:`QuantProtocol.quantize`); the pairing and the audit are the caller's."""
        owner = record.owners[role]
        index = record.indices[role]
        if phase is Phase.INFERENCE:
            if index < 0:
                return self.quantize_dynamic(record, role, x, phase, None, prologue)
            snap = record.snapshots[role]  # a private copy of the live state
            if self._policy is None:
                self.calibrate_first_use(None, index, x, snap, role, prologue)
            return self.encode(x, snap, role, prologue), snap
        protocol = self._protocol
        ev = protocol._open
        event = (ev if ev is not None else require_open(ev, f"quantizing {owner}")).event
        if index < 0:
            return self.quantize_dynamic(record, role, x, phase, event, prologue)
        if self._policy is not None:
            return self._policy.quantize(self._port, record, role, x, phase, event, prologue)
        snap = record.snapshots[role]
        encoder = self._encoders.get(role) or self._encoder(role)
        order = self._stream_order
        if phase is Phase.RECOMPUTE:  # read-only: encode_discard's body
            protocol.ledger.recompute_read(event, owner)
            held = record.derived.get(_CODES) if role == "weight" else None  # (kept if weight_codes_once)
            if (
                held is not None
                and held[1] is snap
                and held[2] is prologue
                and held[0] == _parameter_key(x)
                and not in_selective_checkpoint()  # SAC numbers the ops: the recompute issues them all
            ):
                return held[3], snap  # the true forward's codes of this weight, at this snapshot
            scratch = self.discard_slot(x.device, 0 if snap.center is None else snap.center.shape[-1])
            if order.active:
                order.use(x.device, scratch.amax_pending, snap.scale)
            return encoder.encode_record(x, snap, scratch, 0, prologue), snap
        # the true forward: observe's and encode_record's bodies, one lock
        if role in FORWARD_ROLES:
            self._guard.enter(owner, record.stream_ident, stream_scoped=self._stream_scoped)
        protocol.ledger.observe(event, owner, call_site=(record.layer, record.site), recompute=False)
        with self._lock:
            ev.observed.setdefault(owner, index)
        if index in protocol.bank.fresh:  # the first event only; its ops are unseen by SAC
            outside_selective_checkpoint(self.calibrate_first_use, ev.calibrated, index, x, snap, role, prologue)
        with self._lock:  # a registration on another thread must not swap the pending buffers meanwhile
            bank = protocol.bank
            if order.active:
                order.use(x.device, bank.amax_pending, snap.scale)
            data = encoder.encode_record(x, snap, bank, index, prologue)
        if (
            role == "weight"
            and self._recipe.weight_codes_once
            and record.layer not in self._codes_not_kept
            and record.may_recompute
        ):
            # for the recompute: the same parameter, snapshot and stage give these codes
            record.derived[_CODES] = (_parameter_key(x), snap, prologue, data)
        return data, snap

    def quantize_dynamic(self, record: CallRecord, role: str, x: torch.Tensor, phase: Phase, event, stage=None):
        """A stateless role: the recipe's encoder derives the scale from ``x`` itself and returns
        it with the data; the snapshot is the record's stamps with that scale, descale and amax.
        The ledger counts the call (an observation, or a recompute's read); nothing is recorded
        into the bank, so a recompute is read-only by construction (the rules 4 and 5 hold
        trivially), and it is exact when its input is bitwise the true forward's (audited)."""
        owner = record.owners[role]
        if phase is Phase.RECOMPUTE:
            self._protocol.ledger.recompute_read(event, owner)
        elif phase is Phase.FORWARD:
            self.observe(record, role, event, recompute=False)
        if stage is not None and isinstance(stage, Prologue):  # a recipe that does not fuse it
            x = stage.apply(x)
            stage = None
        # (a layer the fallback moved to current scaling: its recipe's encoder, not the protocol's)
        encoder = self._records.encoder_of(record.layer, role)
        data, scale, descale, amax = encoder.encode_dynamic(x, stage)
        snap = record.snapshots[role].with_scales(scale, descale, amax)
        if phase is Phase.FORWARD:
            with self._lock:
                self._records.dynamic[owner] = snap
        return data, snap

    def calibrate_first_use(
        self, calibrated: set | None, index: int, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue=None
    ) -> None:
        """``initial_scale="calibrate"``: an owner with no delayed scale yet gets one from this
        call's own tensor, written into the frozen cells its snapshot views before anything
        reads them (once per event: every later call of the owner in the event, and every
        recompute, reads the same value). Host-side check; the calibration runs on the device."""
        bank = self._protocol.bank
        if index not in bank.fresh or self._config.initial_scale != "calibrate":
            return
        if calibrated is not None:
            if index in calibrated:
                return
            calibrated.add(index)
        x = self._encoder(role).source(x, prologue)  # the first event only: the prologue's output
        with self._lock:
            bank = self._protocol.bank
            self._stream_order.use(x.device, snap.scale)
            bank.calibrate(index, x, snap.scale, snap.descale, self._config.margin, snap.center)

    def observe(self, record: CallRecord, role: str, event: Event, *, recompute: bool) -> None:
        """Count one call of ``role``'s owner in the ledger and mark it observed in the event
        (a forward role's true forward also enters the concurrency guard)."""
        owner = record.owners[role]
        if role_phase(role) == "forward" and not recompute:
            self._guard.enter(owner, record.stream_ident, stream_scoped=self._stream_scoped)
        protocol = self._protocol
        protocol.ledger.observe(event, owner, call_site=(record.layer, record.site), recompute=recompute)
        with self._lock:
            protocol._open.observed.setdefault(owner, record.indices[role])

    def adopt(self, record: CallRecord, role: str, snap: QuantSnapshot, phase: Phase) -> None:
        """Check and count ``role``'s operand quantized before the call with ``snap`` (see
        :meth:`QuantProtocol.adopt`); the pairing and the audit are the caller's.

        Raises:
            StateTransitionError: the snapshot belongs to another owner of the layer.
            StaleSnapshotError: the snapshot belongs to another event.
        """
        owner = record.owners[role]
        if snap.owner != owner:
            raise StateTransitionError(
                f"layer {record.layer!r}: its all-gathered FP8 weight belongs to {snap.owner}, this call is "
                f"{owner}: with FP8 all-gather a layer is called once per event; a layer called at several "
                "sites (weight tying, a module reused) needs fp8_all_gather=False"
            )
        if phase is Phase.INFERENCE:
            return
        event = require_open(self._protocol._open, f"adopting {owner}'s operand").event
        if snap.event != event:
            raise StaleSnapshotError(
                f"{owner}: the all-gathered FP8 weight was quantized in event {snap.event}, this is event "
                f"{event}: a weight gathered in one event cannot serve another"
            )
        if phase is Phase.RECOMPUTE:
            self._protocol.ledger.recompute_read(event, owner)
            return
        self.observe(record, role, event, recompute=False)
        if record.indices[role] < 0:  # a per-call scale: the owner's latest (telemetry)
            with self._lock:
                self._records.dynamic[owner] = snap

    # -- encoding ----------------------------------------------------------------------
    def encode(self, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue: Prologue | None = None):
        """Quantize with ``snap``, recording nothing."""
        self._stream_order.use(x.device, snap.scale)
        return self._encoder(role).encode(x, snap, prologue)

    def discard_slot(self, device: torch.device, width: int) -> _Scratch:
        """Scratch statistics (amax ``[1]``, center max/min ``[1, width]``) that recompute
        records into and nobody reads: see :meth:`encode_discard`."""
        key = (device, width)
        slot = self.scratch.get(key)
        if slot is None:
            f32 = {"dtype": torch.float32, "device": device}
            # allocated during a recompute, which SAC must not see (its true forward did not)
            slot = outside_selective_checkpoint(
                lambda: _Scratch(
                    torch.zeros(1, **f32),
                    torch.zeros(1, width, **f32),
                    torch.zeros(1, width, **f32),
                    torch.zeros(2, 1, dtype=torch.int64, device=device),
                )
            )
            slot = self.scratch.setdefault(key, slot)
        return slot

    def encode_discard(self, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue=None):
        """Recompute's quantize: the true forward's own op (``*_record_amax``, same codes as the
        non-recording op) with ``snap``, its statistics folded into a scratch slot that is
        never read or committed. Issuing the same op as the true forward keeps the op sequence
        identical, which torch's selective activation checkpointing (SAC) requires: it numbers
        ops per overload and replays its saved outputs by that number (a policy may even save
        these codes). The bank is not touched: recompute stays read-only."""
        scratch = self.discard_slot(x.device, 0 if snap.center is None else snap.center.shape[-1])
        self._stream_order.use(x.device, scratch.amax_pending, snap.scale)
        return self._encoder(role).encode_record(x, snap, scratch, 0, prologue)

    def encode_record(self, index: int, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue=None):
        """Quantize with ``snap`` and record into owner ``index``'s pending statistics.

        Under the lock: a registration on another thread must not swap the pending buffers
        between reading them here and the record landing in them.
        """
        with self._lock:
            bank = self._protocol.bank
            self._stream_order.use(x.device, bank.amax_pending, snap.scale)
            return self._encoder(role).encode_record(x, snap, bank, index, prologue)
