"""The host side of calls captured in CUDA graphs (per-block graphs, ``block_graphs.py``).

A graph replays the device work of its calls but none of their Python: :class:`GraphTemplates`
takes what the captured calls did on the host (owners observed and committed, the ledger's
counts, the frozen scales they read) as a :class:`GraphTemplate`, and repeats it in a later
event at a replay, so that every rule of the protocol still holds without Python per call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import StateTransitionError
from ..state import EventRecord, FrozenScales
from .events import require_open

__all__ = ["GraphTemplate", "GraphTemplates"]


class GraphTemplate(NamedTuple):
    """The host side of calls captured in CUDA graphs (:meth:`QuantProtocol.graph_template`)."""

    observed: dict  # OwnerKey -> bank index, as the capture observed them
    committed: frozenset  # owners the capture committed (a defect policy commits at once)
    records: dict  # OwnerKey -> EventRecord: the ledger's counts of the captured calls
    frozen: FrozenScales | None  # the frozen scales the graphs read
    version: int  # the bank version they were captured against


class GraphTemplates:
    """Takes and replays :class:`GraphTemplate` s against a protocol's open event."""

    def __init__(self, protocol) -> None:
        """
        Args:
            protocol: the :class:`~lightning_fp8state.protocol.QuantProtocol` whose open event,
                bank and ledger it reads (each may be replaced: read per use).
        """
        self._protocol = protocol
        self._lock = protocol._lock
        self._stream_order = protocol.stream_order

    def freeze_event(self, device: torch.device) -> FrozenScales:
        """See :meth:`QuantProtocol.freeze_event`."""
        protocol = self._protocol
        ev = require_open(protocol._open, "freeze_event()")
        with self._lock:
            if ev.frozen is None or ev.frozen.version != protocol.bank.version:
                self._stream_order.structural(device)
                ev.frozen = protocol.bank.freeze()
            return ev.frozen

    def take(self, since: GraphTemplate | None = None) -> GraphTemplate:
        """See :meth:`QuantProtocol.graph_template`."""
        protocol = self._protocol
        ev = require_open(protocol._open, "graph_template()")
        with self._lock:
            records = {}
            for o, r in protocol.ledger.event(ev.event).items():
                b = since.records.get(o) if since is not None else None
                if b is None:
                    records[o] = EventRecord(
                        r.observations, r.commits, r.recompute_reads, r.recompute_records, set(r.sites)
                    )
                    continue
                counts = (
                    r.observations - b.observations,
                    r.commits - b.commits,
                    r.recompute_reads - b.recompute_reads,
                    r.recompute_records - b.recompute_records,
                )
                if any(counts):
                    records[o] = EventRecord(*counts, set(r.sites))
            observed = {o: i for o, i in ev.observed.items() if since is None or o not in since.observed}
            committed = frozenset(ev.committed - (since.committed if since is not None else frozenset()))
            return GraphTemplate(observed, committed, records, ev.frozen, protocol.bank.version)

    def replay(self, template: GraphTemplate) -> None:
        """See :meth:`QuantProtocol.replay_template`."""
        protocol = self._protocol
        ev = require_open(protocol._open, "a CUDA-graph replay")
        with self._lock:
            bank = protocol.bank
            if template.version != bank.version:
                raise StateTransitionError(
                    "a CUDA-graph replay: the state bank was reallocated after the capture (a new owner "
                    "registered, or load_state_dict/to() ran), so the graphs would read and write the old "
                    "tensors: capture again"
                )
            if template.frozen is None:  # nothing quantized (the bf16 recipe)
                pass
            elif ev.frozen is None:
                self._stream_order.structural(bank.device)
                ev.frozen = bank.freeze_into(template.frozen)
            elif ev.frozen is not template.frozen:  # an eager call froze first: the same values
                template.frozen.scales.copy_(ev.frozen.scales)
                if template.frozen.centers is not None:
                    template.frozen.centers.copy_(ev.frozen.centers)
            for owner, index in template.observed.items():
                ev.observed.setdefault(owner, index)
            ev.committed.update(template.committed)
        protocol.ledger.replay(ev.event, template.records, partial=True)
