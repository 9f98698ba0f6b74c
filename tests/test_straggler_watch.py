"""The straggler watch's arithmetic (trainer/health/stragglers.py); its end-to-end behaviour is
in tests/test_heal.py (a slow rank named)."""

import random
import statistics

from trainer.health.stragglers import StragglerWatch, medians_of_others


def test_medians_of_others_equal_the_median_of_a_copy():
    rng = random.Random(0)
    for n in (1, 2, 3, 4, 5, 8, 33):
        for _ in range(20):
            times = [rng.choice([0.1, 0.2, rng.random()]) for _ in range(n)]
            want = [
                statistics.median(times[:r] + times[r + 1 :]) if n > 1 else times[r]
                for r in range(n)
            ]
            assert medians_of_others(times) == want, times


def test_a_slow_rank_is_named_after_the_steps_in_a_row():
    lines = []
    watch = StragglerWatch(1.5, 2, 0, 4, log=lines.append)
    for step in (1, 2, 3):
        scalars = watch.update(step, [1.0, 1.0, 2.0, 1.1])
    assert scalars["timing/slowest_rank"] == 2.0 and scalars["timing/step_time_max"] == 2.0
    assert lines == [
        "straggler: rank 2 slower than the other ranks' median by more than 1.5x "
        "for 2 steps in a row (step 2: 2.000s against 1.000s)"
    ]
