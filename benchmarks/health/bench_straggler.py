"""The straggler watch's per-step cost at many ranks (trainer/health/stragglers.py): every rank
runs `StragglerWatch.update` on the world's step times each step.

    python benchmarks/health/bench_straggler.py [--ranks 1024] [--repeats 20]

Prints the median time of one update at --ranks simulated ranks (one slow), beside the
per-rank median of a copy of the others (the former O(W^2 log W) way) as the baseline.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO  # noqa: F401  (puts the repo on sys.path)
from trainer.health.stragglers import StragglerWatch


def naive(times: list[float]) -> list[float]:
    return [statistics.median(times[:r] + times[r + 1 :]) for r in range(len(times))]


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    times = [0.5 + 0.01 * rng.random() for _ in range(args.ranks)]
    times[7] = 2.0
    watch = StragglerWatch(1.5, 3, 0, args.ranks, log=lambda line: None)
    step = [0]

    def update():
        step[0] += 1
        watch.update(step[0], times)

    now = timed(update, args.repeats)
    before = timed(lambda: naive(times), max(3, args.repeats // 5))
    print(
        f"straggler watch, {args.ranks} ranks: update {now * 1e3:.2f} ms per step "
        f"(goal < 5 ms); the per-rank median of the others, as before: {before * 1e3:.1f} ms "
        f"({before / now:.0f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
