"""The seed's defects, reproduced on purpose as quantize policies, so the audit can prove it
catches them. The protocol never imports this module: :class:`~lightning_fp8state.Fp8State`
hands it the policy that ``QuantConfig.mode`` names (``None`` for ``safe``, the rules).

- ``naive`` (:class:`NaiveTiming`): quantize with the live state, record even in recompute,
  advance at once, and hand the consumer the *live* descale (and center), which by then
  belong to the next call (bug class one: advance before the consumer is done, and a
  recompute that is not read-only).
- ``naive_snapshot`` (:class:`OwnerSnapshot`): the seed's first attempted fix: snapshot the
  owner's live state before a per-call advance and replay *the owner's* latest snapshot in
  recompute. Right when every owner is entered once per event; with a shared owner
  (``ownership="per_model"``, bug class two) it faithfully preserves another layer's value.
"""

from __future__ import annotations

from .errors import StateTransitionError
from .recompute import Phase
from .sac import outside_selective_checkpoint as hidden  # the copies and the commits: unseen by SAC

__all__ = ["NaiveTiming", "OwnerSnapshot", "policy_for"]


class NaiveTiming:
    """``mode="naive"``: the seed's defective timing (see the module doc)."""

    def quantize(self, protocol, record, role, x, phase, event, prologue=None):
        recompute = phase is Phase.RECOMPUTE
        protocol.observe(record, role, event, recompute=recompute)
        live = hidden(protocol.live_snapshot, record, role, event)
        q = protocol.encode_record(record, role, x, live, prologue)
        hidden(protocol.commit_now, record, role, event)
        # the consumer gets the live descale (and center), already advanced for the next call
        # (copies only so that GEMMs get aligned scale pointers; the values are the defect's)
        return q, hidden(protocol.live_snapshot, record, role, event)


class OwnerSnapshot:
    """``mode="naive_snapshot"``: the seed's first attempted fix (see the module doc)."""

    def __init__(self) -> None:
        self._event = None
        self._snapshots: dict = {}  # OwnerKey -> the owner's latest snapshot in the event

    def quantize(self, protocol, record, role, x, phase, event, prologue=None):
        owner = record.owners[role]
        if event != self._event:
            self._event, self._snapshots = event, {}
        if phase is Phase.RECOMPUTE:
            snap = self._snapshots.get(owner)
            if snap is None:
                raise StateTransitionError(f"{owner} is being recomputed in event {event} but ran no true forward")
            protocol.ledger.recompute_read(event, owner)
            return protocol.encode_discard(x, snap, role, prologue), snap
        protocol.observe(record, role, event, recompute=False)
        snap = hidden(protocol.live_snapshot, record, role, event)
        self._snapshots[owner] = snap
        q = protocol.encode_record(record, role, x, snap, prologue)
        hidden(protocol.commit_now, record, role, event)
        return q, snap


_POLICIES = {"naive": NaiveTiming, "naive_snapshot": OwnerSnapshot}


def policy_for(mode: str):
    """A new quantize policy for ``QuantConfig.mode``: ``None`` for ``safe`` (the rules)."""
    policy = _POLICIES.get(mode)
    return None if policy is None else policy()
