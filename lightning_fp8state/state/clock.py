"""LogicalClock: the (step, microbatch) a quantizer event belongs to."""

from __future__ import annotations

from ..config import require_int
from ..errors import StateTransitionError

__all__ = ["Event", "LogicalClock"]

Event = tuple[int, int]


class LogicalClock:
    """Which logical event is running; events only move forward.

    A logical event is one microbatch's forward + backward. Every snapshot is stamped
    with the event it was taken in.
    """

    def __init__(self) -> None:
        self.event: Event | None = None
        self.last: Event | None = None

    def begin(self, step: int | None, microbatch: int) -> Event:
        if self.event is not None:
            raise StateTransitionError(
                f"event {self.event} is still open: close it (leave state.step()) before starting another"
            )
        if step is None:
            step = 0 if self.last is None else self.last[0] + 1
        require_int("step", step, 0)
        require_int("microbatch", microbatch, 0)
        event = (step, microbatch)
        if self.last is not None and event <= self.last:
            raise StateTransitionError(
                f"event (step={step}, microbatch={microbatch}) is not after the last one {self.last}: "
                "logical events only move forward (a repeated event would commit twice). After "
                f"load_state_dict, continue the step numbers from the saved clock: the next step is "
                f"{self.last[0] + 1} (e.g. `for step in range({self.last[0] + 1}, n)`), or a later "
                f"microbatch of step {self.last[0]}; `state.step()` with no step number does this"
            )
        self.event = event
        return event

    def end(self) -> None:
        self.last, self.event = self.event, None

    def state_dict(self) -> dict:
        return {"last": None if self.last is None else list(self.last)}

    def load_state_dict(self, sd: dict) -> None:
        self.last = None if sd["last"] is None else (int(sd["last"][0]), int(sd["last"][1]))
        self.event = None
