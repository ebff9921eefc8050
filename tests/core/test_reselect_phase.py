"""reselect's countdowns on the host (decoder/gpu/reselect_phase.py): they move as the device's
do (select at 0, then r - 1 carried steps), a step of carrying rows alone is lean, and a row due
to select waits while others carry, at most r - 1 steps, after which the rows are in phase."""

import pytest

from ctxcache.decoder.gpu.reselect_phase import ReselectPhase


def test_a_row_selects_once_in_r_steps():
    phase = ReselectPhase(3, rows=2)
    assert [phase.stepped([0]) for _ in range(7)] == [False, True, True, False, True, True, False]
    phase.reset(0)
    assert phase.stepped([0]) is False  # a new stream selects first


def test_reselect_one_carries_nothing_and_holds_nothing():
    phase = ReselectPhase(1, rows=2)
    assert not any(phase.stepped([0, 1]) for _ in range(4))
    assert phase.holds([0, 1]) == [False, False]


def test_a_joiner_waits_for_the_step_where_the_others_select():
    phase = ReselectPhase(3, rows=3)
    phase.stepped([0, 1])  # both select: two carried steps follow
    assert phase.holds([0, 1, 2]) == [False, False, True]  # 2 joined: it would select beside carriers
    assert phase.stepped([0, 1]) is True
    assert phase.holds([0, 1, 2]) == [False, False, True]
    assert phase.stepped([0, 1]) is True
    assert phase.holds([0, 1, 2]) == [False, False, False]  # all due now
    assert phase.stepped([0, 1, 2]) is False
    for _ in range(2):  # in phase from here: every carried step is lean, nobody is held
        assert phase.holds([0, 1, 2]) == [False, False, False]
        assert phase.stepped([0, 1, 2]) is True


def test_no_row_waits_more_than_r_minus_one_steps_in_a_row():
    phase = ReselectPhase(2, rows=3)
    phase.stepped([0])
    phase.stepped([0, 1])  # 0 carried and is due next step, 1 selected and carries next: out of phase
    assert phase.holds([0, 1]) == [True, False]
    phase.stepped([1])
    phase.stepped([2])  # another stream keeps carrying while 0 still waits
    assert phase.holds([0, 2]) == [False, False]  # held once already (r - 1 = 1): 0 steps now


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="reselect=0"):
        ReselectPhase(0, rows=1)
