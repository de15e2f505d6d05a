"""What a :class:`~lightning_fp8state.protocol.QuantProtocol` lets in from outside: a quantize
policy in place of the rules, and auditors that watch each call.

A quantize policy (:mod:`lightning_fp8state.defects`: the seed's defects, reproduced on purpose
for the audit) is handed in by the facade; the protocol never imports it. Its
``quantize(port, record, role, x, phase, event, prologue)`` gets a :class:`PolicyPort` and may
do only what the port offers. Auditors (:mod:`lightning_fp8state.audit`) get every quantized
operand (:func:`observe_operand`) and every module output (:func:`observe_output`), outside
selective activation checkpointing (their copies are no ops of the model's).
"""

from __future__ import annotations

import torch

from ..recompute import CallRecord, Phase
from ..sac import outside_selective_checkpoint
from ..state import Event, Ledger, QuantSnapshot

__all__ = ["PolicyPort", "observe_operand", "observe_output"]


class PolicyPort:
    """What a quantize policy handed to :class:`~lightning_fp8state.protocol.QuantProtocol` may
    do in place of the rules. Public and stable: the policies use these and nothing else."""

    def __init__(self, protocol, quantizer, records, commits) -> None:
        """
        Args:
            protocol: the protocol the policy quantizes for (its ledger is read per use).
            quantizer: its :class:`~lightning_fp8state.protocol.encode.Quantizer`.
            records: its :class:`~lightning_fp8state.protocol.records.CallRecords`.
            commits: its :class:`~lightning_fp8state.protocol.events.Commits`.
        """
        self._protocol = protocol
        self._quantizer = quantizer
        self._records = records
        self._commits = commits

    @property
    def ledger(self) -> Ledger:
        """The protocol's ledger (a recompute's read is counted there: ``recompute_read``)."""
        return self._protocol.ledger

    def observe(self, record: CallRecord, role: str, event: Event, *, recompute: bool) -> None:
        """Count one call of ``role``'s owner in the ledger (an observation, or with
        ``recompute`` a recompute's observation) and mark the owner observed in the event."""
        self._quantizer.observe(record, role, event, recompute=recompute)

    def live_snapshot(self, record: CallRecord, role: str, event: Event) -> QuantSnapshot:
        """A snapshot of ``role``'s owner holding a *copy* of its live (not frozen) state,
        stamped with ``record``'s region and ordinal."""
        owner, index = record.owners[role], record.indices[role]
        return self._records.live_snapshot(owner, index, event, record.region, record.ordinal, role, copy=True)

    def encode_record(self, record: CallRecord, role: str, x: torch.Tensor, snap: QuantSnapshot, prologue=None):
        """Encode ``x`` with ``snap`` and record its amax into the owner's pending slot."""
        return self._quantizer.encode_record(record.indices[role], x, snap, role, prologue)

    def encode_discard(self, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue=None):
        """Encode ``x`` with ``snap`` through the recording op, its statistics discarded
        (recompute's encode: the same op sequence as the true forward, the bank untouched)."""
        return self._quantizer.encode_discard(x, snap, role, prologue)

    def commit_now(self, record: CallRecord, role: str, event: Event) -> None:
        """Commit ``role``'s owner at once (the rules commit in batches at ``commit_forward``
        and ``end_event``)."""
        self._commits.commit_now(record.owners[role], record.indices[role], event)


def observe_operand(auditors: list, record: CallRecord, role: str, phase: Phase, data, snap: QuantSnapshot) -> None:
    """Hand one quantized operand (FP8 codes, or FP4 ``(packed, block_scales)``) and its
    snapshot to the auditors that compare operands (``observe_operand``)."""
    for auditor in auditors:
        observe = getattr(auditor, "observe_operand", None)
        if observe is not None:  # the auditors' copies: unseen by SAC
            outside_selective_checkpoint(observe, record, role, phase, data, snap)


def observe_output(auditors: list, record: CallRecord, phase: Phase, output, snaps: dict) -> None:
    """Hand one module output (a tensor, or a tuple of tensors) and a copy of the snapshots it
    consumed to ``auditors`` (at least one: the caller checks, so no copy is taken without)."""
    snaps = dict(snaps)
    for auditor in auditors:  # the auditors' copies: unseen by SAC
        outside_selective_checkpoint(auditor.observe, record, phase, output, snaps)
