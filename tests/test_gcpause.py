"""planlab.gcpause: the collector paused around cycle-free work, and what the block keeps moved to
the oldest generation when it ends, without any object lost or left frozen."""

from __future__ import annotations

import gc
import weakref

import pytest

from planlab.gcpause import paused_gc


class _Node:
    """A tracked object that can sit in a cycle and be watched by a weak reference."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def _generation_of(obj: object) -> int:
    return next(g for g in range(3) if any(x is obj for x in gc.get_objects(generation=g)))


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_what_the_outermost_block_keeps_is_in_the_oldest_generation_after_it(collector_on):
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            kept = [_Node() for _ in range(3)]
        assert not gc.isenabled()  # an inner block leaves the collector off
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 50  # the young generation starts empty (a few objects since)
    assert {_generation_of(k) for k in kept} == {2}


def test_a_cycle_made_in_the_block_is_freed_by_a_full_collection(collector_on):
    with paused_gc():
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        watch = weakref.ref(a)
        del a, b
    assert watch() is not None  # promoted, not collected young
    gc.collect()
    assert watch() is None


def test_objects_frozen_by_someone_else_stay_frozen(collector_on):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with paused_gc():
            made = _Node()
        assert gc.get_freeze_count() == frozen  # nothing of theirs unfrozen, nothing of ours frozen
        assert _generation_of(made) == 0
    finally:
        gc.unfreeze()


def test_a_collector_that_was_off_stays_off(collector_on):
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()
    assert gc.get_freeze_count() == 0
