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
from .reduction import AmaxReducer
from .snapshot import QuantSnapshot
from .streams import StreamOrder

__all__ = [
    "ATTENTION_ROLES",
    "BACKWARD_ROLES",
    "FORWARD_ROLES",
    "AmaxReducer",
    "ConcurrencyGuard",
    "Event",
    "EventRecord",
    "FrozenScales",
    "Ledger",
    "LogicalClock",
    "OwnerKey",
    "QuantSnapshot",
    "StateBank",
    "StreamOrder",
    "Violation",
    "current_stream_ident",
    "register_role",
    "role_phase",
    "scoped_owner",
]
