"""Python's garbage collector run at step boundaries, not in the middle of a step.

Python's collector starts a collection whenever enough container objects were allocated since
the last one, wherever the program is. A training step allocates tens of thousands (autograd's
nodes, checkpoint's holders, the protocol's call records and snapshots), so collections land
inside steps. Most are short. The oldest generation's are not: they walk every tracked object
in the process, the model, the optimizer and torch's own (millions after ``torch.compile``),
and take longer than a whole training step at the 350M shape (measured by
``benchmarks/train_step.py --host-waits``; figures in docs/PERFORMANCE.md). The host issues the GPU's
work, so a pause is a stall of the whole run, and under data parallelism every other rank
waits for the slowest at the next collective.

:class:`ManagedCollector` turns the automatic collector off and collects at step boundaries:
the young generations after every step (what this step left in reference cycles: short, the
step's objects are gone by then), the whole heap every ``full_every_n_steps`` steps. After
``freeze_after`` steps it collects once and freezes what is alive (``gc.freeze``): the model,
the optimizer, compiled graphs and the library's state are long-lived, and no later collection
walks them again. :meth:`stop` puts the collector back as it found it. The collector is
process-wide: one policy at a time (a second :meth:`start` raises).
"""

from __future__ import annotations

import gc
import time

from .config import require_int
from .errors import StateTransitionError

__all__ = ["ManagedCollector"]

_ACTIVE: list[ManagedCollector] = []  # the one started policy of this process


class ManagedCollector:
    """Garbage collection at step boundaries (see the module doc).

    Args:
        full_every_n_steps: collect every generation every this many steps (at least 1).
        freeze_after: after this many steps (at least 1), collect everything once and freeze
            what is still alive; no later collection walks it again.

    Use::

        collector = ManagedCollector()
        collector.start()
        try:
            for step in ...:
                train_step()
                collector.step_end()
        finally:
            collector.stop()
    """

    def __init__(self, *, full_every_n_steps: int = 100, freeze_after: int = 2) -> None:
        require_int("full_every_n_steps", full_every_n_steps, 1)
        require_int("freeze_after", freeze_after, 1)
        self.full_every_n_steps = full_every_n_steps
        self.freeze_after = freeze_after
        self.steps = 0
        self.collections = {"young": 0, "full": 0}
        self.pause_ms = 0.0  # the time this policy's collections took, in all
        self.frozen = 0  # objects frozen after freeze_after steps
        self._was_enabled: bool | None = None
        self._frozen_before = 0

    @property
    def active(self) -> bool:
        return self._was_enabled is not None

    def start(self) -> None:
        """Turn the automatic collector off; collections now happen in :meth:`step_end`.

        Raises:
            StateTransitionError: another policy (or this one) is already started.
        """
        if _ACTIVE:
            raise StateTransitionError(
                "a ManagedCollector is already started in this process: Python's collector is "
                "process-wide, so one policy runs at a time. stop() it first"
            )
        self.steps = 0  # each start counts its own steps: a second fit freezes after its own warm-up
        self._was_enabled = gc.isenabled()
        self._frozen_before = gc.get_freeze_count()  # someone else's frozen objects: left frozen
        gc.disable()
        _ACTIVE.append(self)

    def step_end(self) -> None:
        """Collect at this step boundary: the young generations, or the whole heap every
        ``full_every_n_steps`` steps (at ``freeze_after``: the whole heap, then freeze)."""
        if not self.active:
            raise StateTransitionError("ManagedCollector.step_end() before start()")
        self.steps += 1
        t0 = time.perf_counter()
        if self.steps == self.freeze_after:
            gc.collect()
            gc.freeze()
            self.frozen = gc.get_freeze_count() - self._frozen_before
            self.collections["full"] += 1
        elif self.steps % self.full_every_n_steps == 0:
            gc.collect()
            self.collections["full"] += 1
        else:
            gc.collect(1)
            self.collections["young"] += 1
        self.pause_ms += (time.perf_counter() - t0) * 1e3

    def stop(self) -> None:
        """Unfreeze what :meth:`step_end` froze (unless objects were frozen before
        :meth:`start`: Python unfreezes all or nothing, so theirs and ours stay frozen) and restore the automatic collector as
        :meth:`start` found it. A no-op when not started."""
        if not self.active:
            return
        if self.frozen and not self._frozen_before:  # (Python unfreezes all or nothing)
            gc.unfreeze()
        self.frozen = 0
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
        _ACTIVE.remove(self)

    def __enter__(self) -> ManagedCollector:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
