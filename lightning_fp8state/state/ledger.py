"""Ledger: what each owner observed and committed in each logical event.

The protocol's central invariant is counted here: one commit per owner per event,
however often the layer body is re-entered, and no recording during recompute. In strict
mode a violation raises ``StateTransitionError`` at the moment it happens; otherwise it is
kept in :attr:`Ledger.violations` for telemetry and the audit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

from ..errors import StateTransitionError
from .clock import Event
from .owner import OwnerKey

__all__ = ["EventRecord", "Ledger", "Violation"]


@dataclass
class EventRecord:
    """Per-owner counts for one event."""

    observations: int = 0  # amax recordings in the true forward / backward
    commits: int = 0
    recompute_reads: int = 0  # read-only recompute calls served from a snapshot
    recompute_records: int = 0  # recordings during recompute (always a violation)
    sites: set = field(default_factory=set)  # (layer, site) pairs that observed this owner


@dataclass(frozen=True)
class Violation:
    event: Event | None
    owner: OwnerKey
    kind: str  # second_commit | record_in_recompute | shared_owner | uncommitted
    message: str


class Ledger:
    """Observations and commits per owner, per event and in total."""

    def __init__(self, *, strict: bool = True, window: int = 64) -> None:
        self.strict = strict
        self.window = window
        self._events: OrderedDict[Event, dict[OwnerKey, EventRecord]] = OrderedDict()
        self._commits: defaultdict[OwnerKey, int] = defaultdict(int)
        self._observations: defaultdict[OwnerKey, int] = defaultdict(int)
        self.violations: list[Violation] = []
        self._lock = threading.Lock()

    # -- recording -----------------------------------------------------------------
    def _record(self, event: Event, owner: OwnerKey) -> EventRecord:
        per_event = self._events.get(event)
        if per_event is None:
            per_event = self._events[event] = {}
            while len(self._events) > self.window:
                self._events.popitem(last=False)
        rec = per_event.get(owner)
        if rec is None:
            rec = per_event[owner] = EventRecord()
        return rec

    def _violate(self, event: Event | None, owner: OwnerKey, kind: str, message: str) -> None:
        self.violations.append(Violation(event, owner, kind, message))
        if self.strict:
            raise StateTransitionError(message)

    def observe(self, event: Event, owner: OwnerKey, *, call_site: tuple[str, int], recompute: bool) -> None:
        """Count one amax recording of ``owner`` by ``call_site`` (layer, site)."""
        with self._lock:
            per_event = self._events.get(event)  # (the open event's record, found without _record's frame)
            rec = per_event.get(owner) if per_event is not None else None
            if rec is None:
                rec = self._record(event, owner)
            if recompute:
                rec.recompute_records += 1
                self._observations[owner] += 1
                self._violate(
                    event,
                    owner,
                    "record_in_recompute",
                    f"{owner} recorded an amax during recompute of event {event}: recompute must "
                    "be read-only (it reuses the true forward's snapshot)",
                )
                return
            rec.observations += 1
            self._observations[owner] += 1
            rec.sites.add(call_site)
            if len(rec.sites) > 1:
                self._violate(
                    event,
                    owner,
                    "shared_owner",
                    f"{owner} was entered by {len(rec.sites)} call sites {sorted(rec.sites)} in event "
                    f"{event}: one state shared by several layers is the wrong owner (ownership "
                    "scope too coarse, e.g. per_model); give each layer its own state",
                )

    def recompute_read(self, event: Event, owner: OwnerKey) -> None:
        with self._lock:
            per_event = self._events.get(event)
            rec = per_event.get(owner) if per_event is not None else None
            (rec if rec is not None else self._record(event, owner)).recompute_reads += 1

    def commit(self, event: Event, owners: list[OwnerKey]) -> None:
        """Count one commit (one history/scale advance) for each of ``owners``."""
        with self._lock:
            for owner in owners:
                rec = self._record(event, owner)
                rec.commits += 1
                self._commits[owner] += 1
                if rec.commits > 1:
                    self._violate(
                        event,
                        owner,
                        "second_commit",
                        f"{owner} committed {rec.commits} times in event {event}: state must advance "
                        "exactly once per owner per logical event",
                    )

    def replay(self, event: Event, template: dict[OwnerKey, EventRecord], *, partial: bool = False) -> None:
        """Count ``event`` as a replay of a captured event whose per-owner records are
        ``template`` (a CUDA graph runs the captured device work again: the same recordings,
        recompute reads and commits, with no Python per call; see ``graphs.py``).

        What the capture violated, the replay violates again, and is counted (or raised, in
        strict mode) the same way: a replay of a defect is no less a defect.

        Args:
            partial: the template is a part of the open event (per-block graphs,
                ``graphs/blocks.py``): its counts are added to what the event counted so far,
                and the event's end checks it as usual. Otherwise the template is the whole
                event, which must be new, and is checked now.
        """
        with self._lock:
            if not partial and event in self._events:
                raise StateTransitionError(f"event {event} was already counted: a replay is a new logical event")
            for owner, rec in template.items():
                mine = self._record(event, owner)
                mine.observations += rec.observations
                mine.commits += rec.commits
                mine.recompute_reads += rec.recompute_reads
                mine.recompute_records += rec.recompute_records
                mine.sites |= rec.sites
                self._commits[owner] += rec.commits
                self._observations[owner] += rec.observations + rec.recompute_records
        for owner, rec in template.items():
            if rec.recompute_records:
                self._violate(
                    event,
                    owner,
                    "record_in_recompute",
                    f"{owner} recorded an amax during recompute of "
                    f"event {event} (a CUDA-graph replay of a capture that did)",
                )
            if len(rec.sites) > 1:
                self._violate(
                    event,
                    owner,
                    "shared_owner",
                    f"{owner} was entered by {len(rec.sites)} call sites "
                    f"in event {event} (a CUDA-graph replay of a capture that was)",
                )
            if rec.commits > 1:
                self._violate(
                    event,
                    owner,
                    "second_commit",
                    f"{owner} committed {rec.commits} times in event "
                    f"{event} (a CUDA-graph replay of a capture that did)",
                )
        if not partial:
            self.check_event(event)

    def check_event(self, event: Event) -> None:
        """At an event's end: every owner that observed was committed exactly once."""
        for owner, rec in list(self._events.get(event, {}).items()):
            if rec.observations and rec.commits == 0:
                self._violate(
                    event,
                    owner,
                    "uncommitted",
                    f"{owner} observed an amax in event {event} but was never committed",
                )

    # -- queries -------------------------------------------------------------------
    def commits(self, owner: OwnerKey, event: Event | None = None) -> int:
        """Commits of ``owner`` in total, or in one ``event`` (kept for the last ``window``)."""
        if event is None:
            return self._commits.get(owner, 0)
        rec = self._events.get(event, {}).get(owner)
        return 0 if rec is None else rec.commits

    def observations(self, owner: OwnerKey, event: Event | None = None) -> int:
        if event is None:
            return self._observations.get(owner, 0)
        rec = self._events.get(event, {}).get(owner)
        return 0 if rec is None else rec.observations + rec.recompute_records

    def event(self, event: Event) -> dict[OwnerKey, EventRecord]:
        """The per-owner records of one event (empty if outside the window)."""
        return dict(self._events.get(event, {}))

    def events(self) -> list[Event]:
        return list(self._events)

    def owners(self) -> list[OwnerKey]:
        return sorted(set(self._commits) | set(self._observations))

    @property
    def ok(self) -> bool:
        return not self.violations

    # -- checkpoint ----------------------------------------------------------------
    def state_dict(self) -> dict:
        owners = self.owners()
        return {
            "owners": [o.as_list() for o in owners],
            "commits": [self._commits.get(o, 0) for o in owners],
            "observations": [self._observations.get(o, 0) for o in owners],
            "violations": len(self.violations),
        }

    def load_state_dict(self, sd: dict) -> None:
        owners = [OwnerKey.from_list(o) for o in sd["owners"]]
        self._commits = defaultdict(int, zip(owners, (int(c) for c in sd["commits"]), strict=False))
        self._observations = defaultdict(int, zip(owners, (int(c) for c in sd["observations"]), strict=False))
        self._events.clear()
        self.violations = []
