"""How long a hung rank costs: SIGSTOP of one rank of a running 2-rank job (from outside, as a
stuck node would), the time until the job has ended with its one line, and with MAX_RESTARTS=1
whether the healed run's final weights are bitwise those of an uninterrupted run.

    python benchmarks/health/bench_hang.py --timeout 15 --workdir /tmp/bench_hang
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.chaos import Launch, train_args  # noqa: E402
from trainer.checkpoint.safe_load import load_tensors  # noqa: E402


def hang(dump: Path, steps: int, timeout: int, at: int, restarts: int) -> dict:
    args = [*train_args(dump, steps, 2, 2), "--comm.train_timeout_seconds", str(timeout)]
    launch = Launch(args, 2, restarts=restarts)
    while launch.running() and max(launch.steps, default=0) < at:
        time.sleep(0.01)
    rank = launch.ranks()[-1]
    os.kill(rank, signal.SIGSTOP)
    stopped = time.monotonic()
    named = None
    while launch.running():
        if named is None and any("stopped responding" in x for x in launch.lines):
            named = time.monotonic() - stopped
        time.sleep(0.01)
    code = launch.finish()
    line = next((x.strip() for x in launch.lines if "stopped responding" in x), "")
    return {
        "exit": code,
        "named_after_s": round(named or -1, 1),
        "line": line,
        "ended_after_s": round(time.monotonic() - stopped, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout", type=int, default=15)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--at", type=int, default=5, help="SIGSTOP after this step is logged")
    p.add_argument("--workdir", type=Path, default=Path("outputs/bench_hang"))
    a = p.parse_args(argv)
    ref = a.workdir / "reference"
    assert Launch(train_args(ref, a.steps, 2, 2), 2).finish() == 0
    print("no restarts:", hang(a.workdir / "stop", a.steps, a.timeout, a.at, 0))
    healed = hang(a.workdir / "heal", a.steps, a.timeout, a.at, 1)
    x = load_tensors(ref / "checkpoint" / f"step-{a.steps}")
    y = load_tensors(a.workdir / "heal" / "checkpoint" / f"step-{a.steps}")
    healed["bitwise"] = f"{sum(bool((x[k] == y[k]).all()) for k in x)}/{len(x)} tensors equal"
    print("MAX_RESTARTS=1:", healed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
