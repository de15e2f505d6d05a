"""Quantizer state: owners, the state bank, snapshots, the logical clock, ledger and guard."""

from .bank import FrozenScales, StateBank
from .clock import Event, LogicalClock
from .guard import ConcurrencyGuard, current_stream_ident
from .ledger import EventRecord, Ledger, Violation
from .owner import (
    ATTENTION_ROLES,
    BACKWARD_ROLES,
    FORWARD_ROLES,
    OwnerKey,
    register_role,
    role_phase,
    scoped_owner,
)
from .snapshot import QuantSnapshot

__all__ = [
    "ATTENTION_ROLES",
    "BACKWARD_ROLES",
    "FORWARD_ROLES",
    "ConcurrencyGuard",
    "Event",
    "EventRecord",
    "FrozenScales",
    "Ledger",
    "LogicalClock",
    "OwnerKey",
    "QuantSnapshot",
    "StateBank",
    "Violation",
    "current_stream_ident",
    "register_role",
    "role_phase",
    "scoped_owner",
]
