"""Chaos run: train a tiny model to step K while faulting it at random moments; nothing is lost.

    python scripts/chaos.py --faults 10 --min-during-save 3 --steps 16 --interval 2 --seed 0
    python scripts/chaos.py --kinds all --faults 100 --min-each 10 --min-during-save 30 --steps 80

First an uninterrupted reference run, then the same job launched through run_train.sh (with
MAX_RESTARTS, so the job heals itself where it can) while a seeded schedule injects faults
(scripts/chaos_faults.py: by default SIGKILL of a random rank, SIGTERM / SIGUSR1 to the
launcher; `--kinds all` adds a hung rank (SIGSTOP), a damaged shard of the newest checkpoint,
a save into a full file system and a slow rank), either a few steps after the resume or while
a save is in progress (a `step-N.partial` folder exists). A fault that ends the launch is
followed by a relaunch; a killed or hung rank by the job's own restart, until step K.

Checked and printed at the end: every restart resumed from the newest committed checkpoint (no
damaged checkpoint, no fallback; after a ckpt-damage, the newest intact one), the steps re-done
per fault are at most the checkpoint interval (a damaged checkpoint costs its own steps too),
every slow rank was named, and the final checkpoint's DCP tensors (model, optimizer, RNG, loaded on
one process) and the TensorBoard losses of every step are bitwise those of the reference run.
Exit code 0 when all of that holds.

`--layout node`, the lost node (scripts/chaos_node.py): an elastic job of two torchrun "nodes"
of 2 ranks loses a whole node (launcher and ranks, SIGKILL) at each fault, shrinks to 2 ranks and
grows back to 4 when a new launcher joins, each time from the newest committed checkpoint; its
losses must be within 1e-4 of an uninterrupted 1-rank run of its global batch (not bitwise:
the world size changes) and every checkpoint left committed. `--kinds` does not apply; it runs
only when named, e.g.
`--layout fsdp,hsdp,tp,pp,cp,ep,node --nproc 4`. `--layout s3` (scripts/chaos_store.py): the
checkpoint folder is an s3:// prefix on moto's server behind a fault proxy that answers a share
(`--store-rate`) of the requests with 503 SlowDown, 500, a timeout or a reset, during saves and
loads, while the schedule's faults go on; nothing may surface, all as bitwise as in fsdp.
A table per layout and kind ends the output.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import chaos_store  # noqa: E402
from scripts.chaos_common import (
    LAYOUTS,
    PACE,
    Launch,  # noqa: E402,F401
    checkpoint_of,
    committed,
    ino,
    partials,
    train_args,
)
from scripts.chaos_faults import (
    CLASSIC,
    ENDING,
    HEALING,
    KINDS,
    SLOW_SECONDS,  # noqa: E402
    Fault,
    damage,
    launch_env,
    schedule,
)
from scripts.chaos_node import node_steps, run_node_chaos  # noqa: E402
from scripts.chaos_report import _figures, ok, report, table  # noqa: E402,F401

MAX_RESTARTS = 1000  # every launch heals its killed and hung ranks itself


@dataclass
class Record:
    fault: Fault
    injected: bool = False
    in_save: bool = False  # a step-N.partial folder existed when the signal was sent
    last_step: int = 0  # the last step the run logged
    committed: int = 0  # the newest committed step after the fault
    expected: int = 0  # the step the next attempt should resume from
    resumed: int | None = None  # the step the next attempt resumed from
    redone: int = 0
    exit_code: int | None = None  # None: the launch went on (healed in-job, or a slow rank)
    seconds: tuple = ()  # (launch to fault, fault to the exit or the restart's resume)
    note: str = ""  # what was damaged, which rank was named


def saving(ckpt: Path, launch: "Launch", stale: set) -> int:
    """The step of a save this launch has in progress (a `step-N.partial` folder it made,
    not one left by an earlier killed launch or attempt), else 0."""
    reached = max(launch.steps, default=0)
    steps = [int(name[5:-8]) for name, ino in partials(ckpt) - stale]
    return max((s for s in steps if s <= reached), default=0)


def wait_for(cond, launch: Launch, timeout: float = 600) -> bool:
    deadline = time.monotonic() + timeout
    while launch.running() and time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def intact(ckpt: Path | str, damaged: set) -> list[int]:
    """The committed steps, less those this run damaged (until they are moved aside)."""
    return [s for s in committed(ckpt) if (s, ino(ckpt, s)) not in damaged]


def inject(
    launch: Launch,
    fault: Fault,
    ckpt: Path,
    rng: random.Random,
    steps: int,
    stale: set,
    damaged: set,
) -> Record:
    """Wait for the fault's moment (or the run's end) and inject it; then wait for the launch
    to end, or, for a killed or hung rank, for the job's own restart to resume. `stale`: the
    partial folders that were there before this launch or attempt."""
    rec = Record(fault)
    if fault.kind == "save-ENOSPC":  # set up at launch: its first save fails
        rec.exit_code = launch.finish()
        rec.injected = rec.in_save = rec.exit_code == 2 and "No space left" in launch.text()
    elif fault.kind == "slow-rank":  # set up at launch: it must be named
        found = wait_for(
            lambda: any(x.startswith("straggler: rank") for x in launch.lines), launch, timeout=120
        )
        rec.note = next((x.strip() for x in launch.lines if x.startswith("straggler:")), "")
        rec.injected = found or launch.running()
        rec.last_step = max(launch.steps, default=0)
        named = rec.note.startswith(f"straggler: rank {fault.rank} ")
        rec.resumed = 0 if named else -2  # -2: the wrong rank, or none, named
    else:
        _signal_at_moment(launch, fault, ckpt, rng, steps, stale, rec)
    signalled = time.monotonic()
    if rec.injected and fault.kind in HEALING:
        resumes = len(launch.resumes)
        wait_for(lambda: len(launch.resumes) > resumes, launch)
        if len(launch.resumes) > resumes:
            rec.resumed = launch.resumes[-1]
    if not launch.running() or fault.kind in ENDING:
        rec.exit_code = launch.finish()
    rec.seconds = (round(signalled - launch.t0, 1), round(time.monotonic() - signalled, 1))
    rec.last_step = (
        max(rec.last_step, *launch.steps, 0)
        if rec.exit_code is not None
        else max(
            rec.last_step, *(launch.steps[: launch.resume_at[-1]] if launch.resume_at else []), 0
        )
    )
    rec.committed = max(intact(ckpt, damaged), default=0)
    if fault.kind != "slow-rank":
        rec.expected = rec.committed
    if fault.kind == "ckpt-damage" and rec.injected and rec.committed:
        rec.note = damage(ckpt, rec.committed, rng)
        damaged.add((rec.committed, ino(ckpt, rec.committed)))
        rec.expected = max(intact(ckpt, damaged), default=0)
    return rec


def _signal_at_moment(
    launch: Launch,
    fault: Fault,
    ckpt: Path,
    rng: random.Random,
    steps: int,
    stale: set,
    rec: Record,
) -> None:
    # A hang needs the training timeout in force: it is set at the end of an attempt's first step.
    least = 2 if fault.kind == "rank-SIGSTOP" else 1
    while launch.running():
        start = launch.attempt_start()
        moment = start is not None and (
            saving(ckpt, launch, stale) >= start + least
            if fault.during_save
            else launch.attempt_steps()[-1] >= min(start + max(fault.offset, least), steps - 1)
        )
        if moment and launch.ranks():
            time.sleep(fault.delay)
            in_save = saving(ckpt, launch, stale)
            if fault.during_save and not in_save:
                continue  # that save committed meanwhile: wait for the next one
            rec.injected = _signal(launch, fault.kind, rng)
            if rec.injected:
                rec.in_save, rec.last_step = bool(in_save), in_save  # the save's step was reached
                return
        time.sleep(0.01)


def _signal(launch: Launch, kind: str, rng: random.Random) -> bool:
    try:
        if kind in HEALING:
            ranks = launch.ranks()
            if not ranks:
                return False
            os.kill(rng.choice(ranks), signal.SIGKILL if kind == "rank-SIGKILL" else signal.SIGSTOP)
        else:
            os.kill(launch.proc.pid, signal.SIGUSR1 if kind.endswith("SIGUSR1") else signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def run_chaos(
    workdir: Path,
    *,
    faults: int,
    min_during_save: int,
    steps: int,
    interval: int,
    nproc: int = 2,
    seed: int = 0,
    reference: Path | None = None,
    async_mode: str = "disabled",
    kinds=CLASSIC,
    min_each: int = 0,
    layout: str = "fsdp",
    store=None,
    log=print,
) -> dict:
    """Run the schedule; `reference`: the dump folder of an uninterrupted run of
    train_args(..., steps, interval, nproc) made earlier (else one is made first). The s3
    layout: `store` (chaos_store.Store) serves the bucket behind its fault proxy."""
    workdir.mkdir(parents=True, exist_ok=True)
    ref, dump = reference or workdir / "reference", workdir / "chaos"
    t0 = time.monotonic()
    slow = SLOW_SECONDS  # a slow rank's extra seconds per step: a step's worth, at least
    if reference is None:
        ref_layout = "fsdp" if layout == "s3" else layout  # bitwise against a local folder
        code = Launch(train_args(ref, steps, interval, nproc, layout=ref_layout), nproc).finish(
            timeout=1800
        )
        assert code == 0, f"the reference run failed with exit code {code}"
        took = time.monotonic() - t0
        slow = max(slow, took / steps)  # the launch's start included: more than a step
        log(f"reference run: {steps} steps in {took:.1f}s; a slow rank sleeps {slow:.2f}s a step")
    rng, ckpt, records, damaged = random.Random(seed + 1), checkpoint_of(dump, layout), [], set()
    texts: list[str] = []  # every launch's output
    plan = schedule(seed, faults, min_during_save, kinds, min_each, nproc)
    restarts = MAX_RESTARTS if any(k in HEALING for k in kinds) else 0
    launch = None
    while True:
        fault = plan[len(records)] if len(records) < len(plan) else None
        if launch is None:
            env = launch_env(fault, max(intact(ckpt, damaged), default=0), interval, steps, slow)
            stale = partials(ckpt)
            launch = Launch(
                train_args(dump, steps, interval, nproc, async_mode, layout),
                nproc,
                {"TRAINER_TEST_SLOW_RANK": f"all:{PACE}", **env, **(store.env if store else {})},
                restarts,
            )
            if records:
                _note_resume(records[-1], launch, damaged)
        if fault is None:
            code = launch.finish(timeout=1800)
            texts.append(launch.text())
            assert code == 0, f"the last launch failed ({code}):\n{launch.text()[-3000:]}"
            break
        rec = inject(launch, fault, ckpt, rng, steps, stale, damaged)
        if not rec.injected:  # the run ended before its moment came
            assert launch.finish() == 0, launch.text()[-3000:]
            texts.append(launch.text())
            break
        records.append(rec)
        if rec.resumed is not None and fault.kind in HEALING:
            rec.redone = max(0, rec.last_step - rec.resumed)
        stale = partials(ckpt)  # a killed attempt's partial save is no save in progress
        if rec.exit_code is not None:
            texts.append(launch.text())
            launch = None
        log(
            f"fault {len(records)}: {fault.kind} {'during a save ' if rec.in_save else ''}"
            f"at step {rec.last_step} ({_outcome(rec)}; newest committed: step-{rec.committed}"
            f"{'; ' + rec.note if rec.note else ''}; {rec.seconds[0]}s to the fault, "
            f"{rec.seconds[1]}s to the exit or restart)"
        )
    fig = _figures(
        records,
        ref,
        dump,
        steps,
        interval,
        time.monotonic() - t0,
        kinds,
        final=f"{ckpt}/step-{steps}" if store else None,
    )
    if store is None:
        return fig
    seen = store.figures(texts)  # a store fault that surfaced in a run is a fault not survived
    return {**fig, "store": seen, "data_lost": fig["data_lost"] + seen["surfaced"]}


def _outcome(rec: Record) -> str:
    if rec.exit_code is not None:
        return f"exit {rec.exit_code}"
    if rec.fault.kind in HEALING:
        return f"healed in-job, resumed at step {rec.resumed}"
    return "the launch goes on"


def _note_resume(rec: Record, launch: Launch, damaged: set) -> None:
    """Fill in where the launch after a fault resumed from (waits for its first step)."""
    while (
        launch.running()
        and not launch.steps
        and not any("nothing to do" in x for x in launch.lines)
    ):
        time.sleep(0.02)
    text = launch.text()
    m = re.search(r"resumed from \S+ \(step (\d+)\)", text)
    rec.resumed = int(m.group(1)) if m else 0
    skipped = {
        int(n)
        for line in launch.lines
        if line.startswith("damaged checkpoint")
        for n in re.findall(r"step-(\d+) \(", line)
    }
    if skipped - {step for step, _ in damaged}:
        rec.resumed = -1  # a fallback past a checkpoint this run did not damage: a loss
    rec.redone = max(0, rec.last_step - rec.resumed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--min-during-save", type=int, default=3)
    p.add_argument("--steps", type=int, default=24, help="node: 16 a fault + 4, at least")
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--async-mode",
        default="disabled",
        choices=("disabled", "async"),
        help="checkpoint.async_mode of the faulted runs (the reference saves sync)",
    )
    p.add_argument(
        "--kinds",
        default="classic",
        help="classic (rank-SIGKILL, launcher-SIGTERM/SIGUSR1), all, or a "
        f"comma-separated list of {', '.join(KINDS)} (the lost node is a layout: "
        "--layout node)",
    )
    p.add_argument("--min-each", type=int, default=0, help="faults of each kind, at least")
    p.add_argument(
        "--store-rate",
        type=float,
        default=0.1,
        help="s3 layout: the share of object-store requests the proxy faults",
    )
    p.add_argument("--workdir", type=Path, default=Path("outputs/chaos"))
    p.add_argument(
        "--layout",
        default="fsdp",
        help=f"the parallelism: {', '.join(LAYOUTS)}, or node (a lost node: two "
        "elastic nodes of 2 ranks, fsdp, --kinds ignored), or a comma-separated list "
        "that spreads the faults over several (one reference and one faulted job "
        "each); s3: fsdp with the checkpoints on an S3 server behind a fault "
        "proxy; every layout but fsdp, s3 and node needs --nproc 4",
    )
    a = p.parse_args(argv)
    kinds = {"classic": CLASSIC, "all": KINDS}.get(a.kinds) or tuple(a.kinds.split(","))
    if set(kinds) - set(KINDS):
        p.error(
            f"--kinds {a.kinds!r}: choose from {', '.join(KINDS)}, classic or all (a lost "
            "node is --layout node)"
        )
    layouts = a.layout.split(",")
    unknown = [x for x in layouts if x not in (*LAYOUTS, "node")]
    if unknown or (a.nproc < 4 and set(layouts) - {"fsdp", "node", "s3"}):
        p.error(
            f"--layout {a.layout!r}: choose from {', '.join(LAYOUTS)}, node (all but fsdp, "
            "s3 and node with --nproc 4)"
        )
    if "s3" in layouts and "ckpt-damage" in kinds:
        p.error("--layout s3: the kind ckpt-damage damages local files; leave it out")
    verdicts, results = [], []
    for i, layout in enumerate(layouts):
        faults, in_save = (
            n // len(layouts) + (i < n % len(layouts)) for n in (a.faults, a.min_during_save)
        )
        workdir = a.workdir / layout if len(layouts) > 1 else a.workdir
        if layout == "node":
            steps = node_steps(faults, a.steps)
            print(
                f"=== layout node: {faults} lost nodes, 2 nodes of 2 ranks, {steps} steps",
                flush=True,
            )
            fig = run_node_chaos(
                workdir,
                faults=faults,
                min_during_save=in_save,
                steps=steps,
                interval=a.interval,
                seed=a.seed + i,
                async_mode=a.async_mode,
            )
        else:
            print(f"=== layout {layout}: {faults} faults on {a.nproc} ranks", flush=True)
            with contextlib.ExitStack() as stack:
                store = (
                    stack.enter_context(chaos_store.serve(a.store_rate, a.seed + i))
                    if layout == "s3"
                    else None
                )
                fig = run_chaos(
                    workdir,
                    faults=faults,
                    min_during_save=in_save,
                    steps=a.steps,
                    interval=a.interval,
                    nproc=a.nproc,
                    seed=a.seed + i,
                    async_mode=a.async_mode,
                    kinds=kinds,
                    min_each=a.min_each,
                    layout=layout,
                    store=store,
                )
        print(report(fig, a.interval), flush=True)
        results.append((layout, fig))
        verdicts.append((layout, ok(fig, faults, in_save, 0 if layout == "node" else a.min_each)))
    if len(layouts) > 1:
        print("layouts: " + ", ".join(f"{x} {'ok' if v else 'FAILED'}" for x, v in verdicts))
    print(table(results))
    return 0 if all(v for _, v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
