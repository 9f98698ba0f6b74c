"""The faults of scripts/chaos.py: their kinds, the seeded schedule, and what each does.

    rank-SIGKILL      a random rank is killed                         the job restarts itself
    rank-SIGSTOP      a random rank hangs (stopped, never continued)  the job restarts itself
    launcher-SIGTERM  the launcher is signalled: the ranks save and stop (exit 3); relaunched
    launcher-SIGUSR1  the same with SLURM's early-warning signal
    ckpt-damage       the launcher is stopped, then a shard of the newest checkpoint is
                      truncated or deleted: the next launch resumes from the one before
    save-ENOSPC       a launch whose next save finds the file system full (the storage seam,
                      TRAINER_TEST_SAVE_ERROR): it stops with one line (exit 2); relaunched
    slow-rank         a launch in which one rank is slow (TRAINER_TEST_SLOW_RANK): it must be
                      named as the straggler; the launch goes on

"The job restarts itself": every launch runs with MAX_RESTARTS, so those faults are healed by
the launcher (torchrun's in-job restart), not by this script. A kind that needs a launch of its
own (save-ENOSPC, slow-rank) follows a fault that ended the previous launch.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

KINDS = (
    "rank-SIGKILL",
    "launcher-SIGTERM",
    "launcher-SIGUSR1",
    "rank-SIGSTOP",
    "ckpt-damage",
    "save-ENOSPC",
    "slow-rank",
)
CLASSIC = KINDS[:3]  # the kinds before in-job restarts (the default of --kinds)
HEALING = ("rank-SIGKILL", "rank-SIGSTOP")
ENDING = ("launcher-SIGTERM", "launcher-SIGUSR1", "ckpt-damage", "save-ENOSPC")
FRESH = ("save-ENOSPC", "slow-rank")  # set up when a launch starts
SLOW_SECONDS = 0.3


@dataclass
class Fault:
    kind: str  # one of KINDS
    during_save: bool  # wait for a save in progress (else: a step after the resume)
    offset: int  # for a step fault: steps after the resume
    delay: float  # seconds after the moment is reached
    rank: int = 0  # save-ENOSPC, slow-rank: the rank it happens on


def schedule(
    seed: int, faults: int, min_during_save: int, kinds=CLASSIC, min_each: int = 0, nproc: int = 2
) -> list[Fault]:
    """`faults` faults of `kinds`, each kind at least `min_each` times, at least
    `min_during_save` of them during a save (a save-ENOSPC always is)."""
    rng = random.Random(seed)
    if tuple(kinds) == CLASSIC and not min_each:  # the original schedule, draw for draw
        return _classic(rng, faults, min_during_save)
    pool = [k for k in kinds for _ in range(min_each)]
    pool += rng.choices(list(kinds), k=max(0, faults - len(pool)))
    order, prev = [], None
    while pool:
        allowed = [i for i, k in enumerate(pool) if k not in FRESH or prev in (None, *ENDING)]
        if not allowed:  # only launch-opening kinds are left: end this launch first
            pool.append("launcher-SIGTERM")
            continue
        prev = pool.pop(rng.choice(allowed))
        order.append(prev)
    signalled = [i for i, k in enumerate(order) if k not in FRESH]
    wanted = max(0, min_during_save - order.count("save-ENOSPC"))
    saves = set(rng.sample(signalled, min(wanted, len(signalled))))
    return [
        Fault(
            k,
            k == "save-ENOSPC" or i in saves or (k not in FRESH and rng.random() < 0.2),
            rng.randint(1, 3),
            rng.uniform(0.0, 0.3),
            rng.randrange(nproc),
        )
        for i, k in enumerate(order)
    ]


def _classic(rng: random.Random, faults: int, min_during_save: int) -> list[Fault]:
    saves = set(rng.sample(range(faults), min(faults, max(min_during_save, 0))))
    out = []
    for i in range(faults):
        during = i in saves or rng.random() < 0.25
        kind = rng.choices(CLASSIC, weights=(0.6, 0.2, 0.2))[0]
        out.append(Fault(kind, during, rng.randint(1, 3), rng.uniform(0.0, 0.3 if during else 0.6)))
    return out


def launch_env(
    fault: Fault | None, newest: int, interval: int, steps: int, slow: float = SLOW_SECONDS
) -> dict:
    """The environment a launch needs for `fault` (a launch-opening kind), else {}. `slow`:
    the seconds a slow rank sleeps per step (a fraction of a step would not be a straggler:
    scaled to the reference run's step time)."""
    if fault is None or fault.kind not in FRESH:
        return {}
    if fault.kind == "slow-rank":
        return {"TRAINER_TEST_SLOW_RANK": f"{fault.rank}:{slow:.3f}"}
    save = min(steps, (newest // interval + 1) * interval)  # the launch's first save
    return {"TRAINER_TEST_SAVE_ERROR": f"{save}:28:{fault.rank}"}  # 28: ENOSPC


def damage(ckpt: Path, step: int, rng: random.Random) -> str:
    """Truncate or delete one shard of checkpoint `step`; what was done."""
    shard = rng.choice(sorted((ckpt / f"step-{step}").glob("*.distcp")))
    if rng.random() < 0.5:
        os.truncate(shard, shard.stat().st_size // 2)
        return f"truncated {shard.name} of step-{step}"
    shard.unlink()
    return f"deleted {shard.name} of step-{step}"
