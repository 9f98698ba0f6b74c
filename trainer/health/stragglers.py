"""Stragglers made visible: every rank's step time, the slowest one named.

Each rank times its step from the step's start until its optimizer step is done (before the
loss all-reduce of a log step, which waits for the slowest rank); the step-end all-reduce
(Loop.agree_at_step_end, trainer/loop.py) already runs every step, and carries one float per
rank (each rank fills its own slot of a world-size vector, the SUM gathers them), so knowing
every rank's time costs no extra collective. Every rank then sees the same times and takes the
same decisions; rank 0 logs `timing/step_time_max`, `timing/slowest_rank`,
`timing/step_time_median` and `timing/step_time_spread` (max / median) on log steps, and a rank
slower than the median of the other ranks by `health.straggler_factor` for
`health.straggler_steps` steps in a row is named in one line (again once it has recovered and
falls behind anew).

What the times can show: collectives inside the step (FSDP's all-gathers and reduce-scatters,
the clip all-reduce) make the other ranks wait for a slow one, so a rank slow before the step's
last collective raises every rank's time; the rank that arrives last at the step end is the one
slow in its own work after that (optimizer step, host-side work). With a `TRAINER_TEST_SLOW_RANK`
of "RANK:SECONDS" that rank sleeps that long after its optimizer step (testing hook).
"""

from __future__ import annotations

import statistics
import time


def medians_of_others(times: list[float]) -> list[float]:
    """For each rank, the median of every other rank's time, from one sort: O(W log W) for W
    ranks (a median per rank over a copy of the others would be O(W^2 log W): ~0.3 s a step at
    1,024 ranks, benchmarks/health/bench_straggler.py)."""
    n = len(times)
    if n == 1:
        return list(times)
    order = sorted(range(n), key=times.__getitem__)
    s = [times[i] for i in order]
    pos = [0] * n
    for j, i in enumerate(order):
        pos[i] = j
    m = n - 1  # the others

    def nth(j: int, removed: int) -> float:  # j-th smallest once `removed` is taken out
        return s[j] if j < removed else s[j + 1]

    out = []
    for r in range(n):
        k = pos[r]
        out.append(nth(m // 2, k) if m % 2 else (nth(m // 2 - 1, k) + nth(m // 2, k)) / 2)
    return out


class StragglerWatch:
    def __init__(self, factor: float, steps: int, rank: int, world: int, log):
        self.factor, self.steps, self.rank, self.world, self.log = factor, steps, rank, world, log
        self.t0, self.elapsed = time.perf_counter(), 0.0
        self.slow_for = [0] * world  # consecutive slow steps per rank
        self.scalars: dict[str, float] = {}

    def start_step(self) -> None:
        self.t0, self.stopped = time.perf_counter(), False

    def stop_step(self) -> None:
        """The step's own work is done: called by the step right after its optimizer step,
        before any collective after it (MoE's load all-reduce would make every rank wait for
        a slow one), and by the loop when the step returns; the first call counts."""
        if not getattr(self, "stopped", False):
            self.elapsed, self.stopped = time.perf_counter() - self.t0, True

    def slots(self) -> list[float]:
        """This rank's step time in its slot of a world-size vector (zeros elsewhere)."""
        out = [0.0] * self.world
        out[self.rank] = self.elapsed
        return out

    def update(self, step: int, times: list[float]) -> dict[str, float]:
        """Every rank's step time (summed slots): the scalars, and the one-line report."""
        median = statistics.median(times)
        slowest = max(range(len(times)), key=lambda r: times[r])
        self.scalars = {
            "timing/step_time_max": times[slowest],
            "timing/slowest_rank": float(slowest),
            "timing/step_time_median": median,
            "timing/step_time_spread": times[slowest] / max(median, 1e-9),
        }
        others_median = medians_of_others(times)
        for r, t in enumerate(times):
            others = others_median[r]
            self.slow_for[r] = self.slow_for[r] + 1 if t > self.factor * others else 0
            if self.steps and self.slow_for[r] == self.steps:
                self.log(
                    f"straggler: rank {r} slower than the other ranks' median by more "
                    f"than {self.factor:g}x for {self.steps} steps in a row (step {step}: "
                    f"{t:.3f}s against {others:.3f}s)"
                )
        return self.scalars
