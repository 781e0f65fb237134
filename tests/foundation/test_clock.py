"""The adjustable clock: moved, frozen and thawed against a base clock the test holds."""

from __future__ import annotations

from foundation.clock import AdjustableClock
from tests.support.stepped_clock import SteppedClock


def test_it_follows_its_base_plus_what_it_was_moved() -> None:
    base = SteppedClock(1_000.0)
    clock = AdjustableClock(base)
    assert clock() == 1_000.0
    clock.advance(30)
    base.now += 5
    assert clock() == 1_035.0
    clock.advance(-10)
    assert clock.state().offset_s == 20.0 and not clock.state().frozen


def test_frozen_it_holds_still_moves_when_told_and_runs_on_when_thawed() -> None:
    base = SteppedClock(1_000.0)
    clock = AdjustableClock(base)
    clock.freeze(True)
    base.now += 100
    assert clock() == 1_000.0
    clock.advance(60)
    assert clock() == 1_060.0 and clock.state().frozen
    clock.freeze(False)  # runs on from the frozen reading, not from the base
    assert clock() == 1_060.0
    base.now += 1
    assert clock() == 1_061.0
    assert clock.state().offset_s == -40.0
