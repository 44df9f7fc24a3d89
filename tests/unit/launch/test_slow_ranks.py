"""The slow-rank policy's decisions (``mover_plugin.launch.slow_ranks``), pure logic."""

import pytest

from mover_plugin.launch.slow_ranks import SlowRank, SlowRankDetector


def _feed(detector: SlowRankDetector, step: int, busy: dict[int, float]):
    return detector.observe(step, busy)


def test_a_rank_slow_for_the_given_number_of_steps_in_a_row_is_reported():
    detector = SlowRankDetector(factor=2.0, steps=3, world_size=4)
    slow_step = {0: 0.1, 1: 0.45, 2: 0.11, 3: 0.09}
    assert _feed(detector, 1, slow_step) is None
    assert _feed(detector, 2, slow_step) is None
    decision = _feed(detector, 3, slow_step)
    assert decision == SlowRank(rank=1, step=3, busy_s=0.45, median_busy_s=pytest.approx(0.105))
    # The decision starts the count again.
    assert _feed(detector, 4, slow_step) is None


def test_a_streak_broken_by_one_normal_step_starts_again():
    detector = SlowRankDetector(factor=2.0, steps=2, world_size=3)
    assert _feed(detector, 1, {0: 1.0, 1: 1.0, 2: 3.0}) is None
    assert _feed(detector, 2, {0: 1.0, 1: 1.0, 2: 1.5}) is None  # 1.5 is not above 2 x 1.0
    assert _feed(detector, 3, {0: 1.0, 1: 1.0, 2: 3.0}) is None
    assert _feed(detector, 4, {0: 1.0, 1: 1.0, 2: 3.0}).rank == 2


def test_a_step_is_judged_once_every_host_reported_it_in_any_order():
    detector = SlowRankDetector(factor=1.5, steps=1, world_size=4)
    assert detector.observe(7, {2: 0.1, 3: 0.1}) is None
    assert detector.observe(6, {0: 0.1, 1: 0.1}) is None  # step 6 is still missing 2 and 3
    decision = detector.observe(7, {0: 0.1, 1: 0.5})
    assert (decision.rank, decision.step) == (1, 7)


def test_ranks_equally_slow_are_not_stragglers_and_reset_forgets_streaks():
    detector = SlowRankDetector(factor=2.0, steps=2, world_size=3)
    assert _feed(detector, 1, {0: 5.0, 1: 5.0, 2: 5.0}) is None
    assert _feed(detector, 2, {0: 0.1, 1: 0.1, 2: 0.5}) is None
    detector.reset()
    assert _feed(detector, 3, {0: 0.1, 1: 0.1, 2: 0.5}) is None  # the streak started again
    assert _feed(detector, 4, {0: 0.1, 1: 0.1, 2: 0.5}).rank == 2
