"""ManagedCollector: Python's garbage collector at step boundaries (lightning_fp8state.collector)."""

from __future__ import annotations

import gc
import weakref

import pytest

from lightning_fp8state import ManagedCollector
from lightning_fp8state.errors import ConfigError, StateTransitionError


class Node:
    """A container that can sit in a reference cycle and be watched through a weak reference."""

    def __init__(self) -> None:
        self.other = None


def cycle() -> weakref.ref:
    """A two-node reference cycle, unreachable once this returns: only a collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def restored():
    """The test leaves Python's collector as it found it, whatever happens."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    if frozen == 0 and gc.get_freeze_count():
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_steps_run_without_the_automatic_collector_and_each_boundary_frees_the_steps_cycles(restored):
    gc.enable()
    collector = ManagedCollector(full_every_n_steps=100, freeze_after=50)
    collector.start()
    try:
        assert not gc.isenabled()
        watched = [cycle() for _ in range(3)]
        for _ in range(2000):  # enough allocations to trigger an automatic collection, were it on
            cycle()
        assert all(w() is not None for w in watched)  # nothing collected in the middle of the step
        collector.step_end()
        assert all(w() is None for w in watched)  # the boundary's young collection freed them
        assert collector.collections == {"young": 1, "full": 0}
    finally:
        collector.stop()
    assert gc.isenabled()


def test_a_cycle_that_reached_the_old_generation_is_freed_by_the_next_full_collection(restored):
    collector = ManagedCollector(full_every_n_steps=3, freeze_after=10)
    with collector:
        holder = [Node()]
        holder[0].other = Node()
        holder[0].other.other = holder[0]
        watched = weakref.ref(holder[0])
        collector.step_end()  # step 1: young; the cycle is alive (held), so it moves to the old generation
        holder.clear()  # now garbage, in the old generation
        collector.step_end()  # step 2: young only: the old generation is not walked
        assert watched() is not None
        collector.step_end()  # step 3: full
        assert watched() is None
        assert collector.collections == {"young": 2, "full": 1}
        assert collector.pause_ms > 0


def test_what_lives_after_the_warm_up_is_frozen_then_unfrozen_at_stop(restored):
    assert gc.get_freeze_count() == 0
    collector = ManagedCollector(freeze_after=2)
    collector.start()
    try:
        long_lived = [Node() for _ in range(10)]
        collector.step_end()
        assert gc.get_freeze_count() == 0
        collector.step_end()
        # (the count falls as frozen objects are freed by reference counting: compare with > 0)
        assert collector.frozen > 0 and gc.get_freeze_count() > 0
        # a frozen object is in no generation a collection walks
        assert not any(obj is long_lived[0] for gen in range(3) for obj in gc.get_objects(generation=gen))
    finally:
        collector.stop()
    assert gc.get_freeze_count() == 0
    assert collector.frozen == 0 and not collector.active


def _frozen(obj) -> bool:
    """Whether the tracked ``obj`` is in the permanent generation (gc.get_objects lists the others)."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_objects_someone_froze_before_start_stay_frozen(restored):
    # an object of the caller's, frozen before the collector starts (the freeze count alone would
    # also drop when some other frozen object dies meanwhile)
    marker = [object()]
    gc.freeze()
    assert _frozen(marker)
    with ManagedCollector(freeze_after=1) as collector:
        collector.step_end()
        assert _frozen(marker)
    assert _frozen(marker) and gc.get_freeze_count() > 0  # Python cannot unfreeze ours alone: all stay frozen


def test_a_disabled_collector_stays_disabled_after_stop(restored):
    gc.disable()
    with ManagedCollector() as collector:
        collector.step_end()
    assert not gc.isenabled()


def test_one_policy_at_a_time_and_no_step_before_start(restored):
    first, second = ManagedCollector(), ManagedCollector()
    with pytest.raises(StateTransitionError, match="before start"):
        first.step_end()
    first.start()
    try:
        with pytest.raises(StateTransitionError, match="already started"):
            second.start()
        with pytest.raises(StateTransitionError, match="already started"):
            first.start()
    finally:
        first.stop()
    first.stop()  # a second stop does nothing
    with second:  # the process is free again
        assert second.active


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"full_every_n_steps": 0}, "full_every_n_steps"),
        ({"freeze_after": 0}, "freeze_after"),
        ({"freeze_after": 1.5}, "freeze_after"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        ManagedCollector(**kwargs)


def test_a_second_start_counts_its_own_warm_up(restored):
    collector = ManagedCollector(freeze_after=2, full_every_n_steps=100)
    for _ in range(2):  # e.g. two Trainer.fit calls with the same callback
        with collector:
            collector.step_end()
            assert gc.get_freeze_count() == 0
            collector.step_end()
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
    assert collector.collections == {"young": 2, "full": 2}
