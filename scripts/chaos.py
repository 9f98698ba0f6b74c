"""Chaos run: train the debug model to step K while killing it at random moments; nothing is lost.

    python scripts/chaos.py --faults 10 --min-during-save 3 --steps 16 --interval 2 --seed 0

First an uninterrupted reference run, then the same job launched through run_train.sh again and
again while a seeded schedule injects one fault per launch: SIGKILL of a random rank, or
SIGTERM / SIGUSR1 to the launcher (which forwards it: the ranks save at the step boundary and
stop), either a few steps after the resume or while a save is in progress (a `step-N.partial`
folder exists). Each fault is followed by a restart, until the run reaches step K.

Checked and printed at the end: every restart resumed from the newest committed checkpoint (no
damaged checkpoint, no fallback), the steps re-done per fault are at most the checkpoint
interval, and the final checkpoint's DCP tensors (model, optimizer, RNG, loaded on one process)
and the TensorBoard losses of every step are bitwise those of the reference run.
Exit code 0 when all of that holds.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("rank-SIGKILL", "launcher-SIGTERM", "launcher-SIGUSR1")


def train_args(dump: Path, steps: int, interval: int, nproc: int,
               async_mode: str = "disabled") -> list[str]:
    """The debug model in tiny fp32 settings on synthetic data (bitwise reproducible)."""
    extra = [] if async_mode == "disabled" else ["--checkpoint.async_mode", async_mode]
    return [*extra, "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--training.global_batch_size", str(2 * nproc),
            "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
            "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.min_lr_factor", "1.0",
            "--data.dataset", "synthetic", "--checkpoint.enable", "true",
            "--checkpoint.interval", str(interval), "--checkpoint.keep_latest_k", "2"]


@dataclass
class Fault:
    kind: str          # one of KINDS
    during_save: bool  # wait for a save in progress (else: a step after the resume)
    offset: int        # for a step fault: steps after the resume
    delay: float       # seconds after the moment is reached


@dataclass
class Record:
    fault: Fault
    injected: bool = False
    in_save: bool = False     # a step-N.partial folder existed when the signal was sent
    last_step: int = 0        # the last step the run logged
    committed: int = 0        # the newest committed step after the run ended
    resumed: int | None = None  # the step the next launch resumed from
    redone: int = 0
    exit_code: int | None = None
    seconds: tuple = ()       # (launch to signal, signal to every process gone)


def schedule(seed: int, faults: int, min_during_save: int) -> list[Fault]:
    rng = random.Random(seed)
    saves = set(rng.sample(range(faults), min(faults, max(min_during_save, 0))))
    out = []
    for i in range(faults):
        during = i in saves or rng.random() < 0.25
        kind = rng.choices(KINDS, weights=(0.6, 0.2, 0.2))[0]
        out.append(Fault(kind, during, rng.randint(1, 3), rng.uniform(0.0, 0.3 if during else 0.6)))
    return out


class Launch:
    """One run_train.sh in its own session, its output collected by a thread."""

    def __init__(self, args: list[str], nproc: int):
        env = dict(os.environ, NGPU=str(nproc), LOG_RANK="0", HF_DATASETS_OFFLINE="1",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([str(REPO / "run_train.sh"), *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.steps: list[int] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.match(r"step:\s+(\d+)", line)
            if m:
                self.steps.append(int(m.group(1)))

    def running(self) -> bool:
        return self.proc.poll() is None

    def ranks(self) -> list[int]:
        """The trainer processes under the launcher (torchrun's workers)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            for path in glob.glob(f"/proc/{pid}/task/*/children"):
                try:
                    kids = [int(p) for p in open(path).read().split()]
                except OSError:
                    continue
                todo += kids
                out += [k for k in kids if b"trainer.train" in _cmdline(k)]
        return sorted(set(out))

    def finish(self, timeout: float = 180) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: a hung run
            code = self.proc.wait()
        self.reader.join(timeout=10)
        _wait_session_gone(self.proc.pid)
        return code

    def text(self) -> str:
        return "".join(self.lines)


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def _wait_session_gone(sid: int, timeout: float = 60) -> None:
    """Wait until no process of the launch's session is left (orphaned ranks), then kill."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in os.listdir("/proc") if p.isdigit() and _session(int(p)) == sid]
        if not alive:
            return
        if time.monotonic() > deadline:
            os.killpg(sid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
        time.sleep(0.1)


def _session(pid: int) -> int | None:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def committed(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step-*") if re.fullmatch(r"step-\d+", p.name))


def partials(ckpt: Path) -> set[tuple[str, int]]:
    out = set()
    for p in ckpt.glob("step-*.partial"):
        try:
            out.add((p.name, p.stat().st_ino))
        except OSError:
            pass
    return out


def saving(ckpt: Path, launch: "Launch", stale: set) -> int:
    """The step of a save this launch has in progress (a `step-N.partial` folder it made,
    not one left by an earlier killed launch), else 0."""
    reached = max(launch.steps, default=0)
    steps = [int(name[5:-8]) for name, ino in partials(ckpt) - stale]
    return max((s for s in steps if s <= reached), default=0)


def inject(launch: Launch, fault: Fault, ckpt: Path, rng: random.Random, steps: int,
           stale: set) -> Record:
    """Wait for the fault's moment (or the run's end), then send the signal. `stale`: the
    partial folders that were there before the launch."""
    rec = Record(fault)
    start = None
    while launch.running():
        if start is None and launch.steps:
            start = launch.steps[0] - 1  # the step this launch resumed from
        moment = (saving(ckpt, launch, stale) if fault.during_save else
                  start is not None and launch.steps[-1] >= min(start + fault.offset, steps - 1))
        if moment and launch.ranks():
            time.sleep(fault.delay)
            in_save = saving(ckpt, launch, stale)
            if fault.during_save and not in_save:
                continue  # that save committed meanwhile: wait for the next one
            rec.injected = _signal(launch, fault.kind, rng)
            if rec.injected:
                rec.in_save, rec.last_step = bool(in_save), in_save  # the save's step was reached
                break
        time.sleep(0.01)
    signalled = time.monotonic()
    rec.exit_code = launch.finish()
    rec.seconds = (round(signalled - launch.t0, 1), round(time.monotonic() - signalled, 1))
    rec.last_step = max(rec.last_step, *launch.steps, 0)
    rec.committed = max(committed(ckpt), default=0)
    return rec


def _signal(launch: Launch, kind: str, rng: random.Random) -> bool:
    try:
        if kind == "rank-SIGKILL":
            ranks = launch.ranks()
            if not ranks:
                return False
            os.kill(rng.choice(ranks), signal.SIGKILL)
        else:
            os.kill(launch.proc.pid, signal.SIGTERM if kind.endswith("SIGTERM") else signal.SIGUSR1)
    except ProcessLookupError:
        return False
    return True


def load_dcp_tensors(path: Path) -> dict:
    """Every tensor of a DCP checkpoint, loaded on this one process (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype)
          for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def tb_losses(dump: Path) -> dict[int, float]:
    sys.path.insert(0, str(REPO))
    from tests.helpers import losses

    return losses(dump)


def run_chaos(workdir: Path, *, faults: int, min_during_save: int, steps: int, interval: int,
              nproc: int = 2, seed: int = 0, reference: Path | None = None,
              async_mode: str = "disabled", log=print) -> dict:
    """Run the schedule; `reference`: the dump folder of an uninterrupted run of
    train_args(..., steps, interval, nproc) made earlier (else one is made first)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ref, dump = reference or workdir / "reference", workdir / "chaos"
    t0 = time.monotonic()
    if reference is None:
        code = Launch(train_args(ref, steps, interval, nproc), nproc).finish(timeout=600)
        assert code == 0, f"the reference run failed with exit code {code}"
        log(f"reference run: {steps} steps in {time.monotonic() - t0:.1f}s")
    rng, ckpt, records = random.Random(seed + 1), dump / "checkpoint", []
    plan = schedule(seed, faults, min_during_save)
    while True:
        stale = partials(ckpt)
        launch = Launch(train_args(dump, steps, interval, nproc, async_mode), nproc)
        if records:
            _note_resume(records[-1], launch, interval)
        fault = plan[len(records)] if len(records) < len(plan) else None
        if fault is None:
            code = launch.finish(timeout=600)
            assert code == 0, f"the last launch failed ({code}):\n{launch.text()[-3000:]}"
            break
        rec = inject(launch, fault, ckpt, rng, steps, stale)
        if not rec.injected:  # the run ended before its moment came
            assert rec.exit_code == 0, launch.text()[-3000:]
            break
        records.append(rec)
        log(f"fault {len(records)}: {fault.kind} {'during a save' if rec.in_save else ''} "
            f"at step {rec.last_step} (exit {rec.exit_code}; newest committed: "
            f"step-{rec.committed}; {rec.seconds[0]}s to the fault, {rec.seconds[1]}s to exit)")
    return _figures(records, ref, dump, steps, interval, time.monotonic() - t0)


def _note_resume(rec: Record, launch: Launch, interval: int) -> None:
    """Fill in where the launch after a fault resumed from (waits for its first step)."""
    while launch.running() and not launch.steps and not any("nothing to do" in x
                                                            for x in launch.lines):
        time.sleep(0.02)
    text = launch.text()
    m = re.search(r"resumed from \S+ \(step (\d+)\)", text)
    rec.resumed = int(m.group(1)) if m else 0
    if "damaged checkpoint" in text:
        rec.resumed = -1  # a fallback past a damaged checkpoint: something was lost
    rec.redone = max(0, rec.last_step - rec.resumed)


def _figures(records, ref: Path, dump: Path, steps: int, interval: int, seconds: float) -> dict:
    final_ref, final = ref / "checkpoint" / f"step-{steps}", dump / "checkpoint" / f"step-{steps}"
    a, b = load_dcp_tensors(final_ref), load_dcp_tensors(final)
    differing = sorted(k for k in a if k not in b or not bool((a[k] == b[k]).all())
                       or a[k].dtype != b[k].dtype)
    ref_losses, got_losses = tb_losses(ref), tb_losses(dump)
    loss_diffs = [s for s in range(1, steps + 1) if got_losses.get(s) != ref_losses.get(s)]
    survived = [r for r in records if r.resumed == r.committed]
    return {
        "faults": len(records),
        "survived": len(survived),
        "during_save": sum(r.in_save for r in records),
        "kinds": {k: sum(r.fault.kind == k for r in records) for k in KINDS},
        "redone": [r.redone for r in records],
        "redone_total": sum(r.redone for r in records),
        "max_redone_ok": all(r.redone <= interval for r in records),
        "tensors": len(a),
        "tensors_differing": differing,
        "loss_steps_differing": loss_diffs,
        "data_lost": len(records) - len(survived) + len(differing) + len(loss_diffs),
        "seconds": round(seconds, 1),
    }


def report(fig: dict, interval: int) -> str:
    kinds = ", ".join(f"{v} {k}" for k, v in fig["kinds"].items())
    return "\n".join([
        f"faults injected: {fig['faults']} ({kinds})",
        f"faults survived: {fig['survived']} (the next launch resumed from the newest committed "
        "step)",
        f"during a save:   {fig['during_save']}",
        f"steps redone:    {fig['redone_total']} in all, per fault {fig['redone']} "
        f"(interval {interval}: {'all within' if fig['max_redone_ok'] else 'SOME BEYOND'})",
        f"final state:     {fig['tensors'] - len(fig['tensors_differing'])}/{fig['tensors']} DCP "
        f"tensors bitwise equal to the uninterrupted run; losses differ at steps "
        f"{fig['loss_steps_differing'] or 'none'}",
        f"data lost:       {fig['data_lost'] or 'none'}",
        f"wall time:       {fig['seconds']}s",
    ])


def ok(fig: dict, faults: int, min_during_save: int) -> bool:
    return (fig["faults"] >= faults and fig["during_save"] >= min_during_save
            and fig["survived"] == fig["faults"] and fig["max_redone_ok"] and fig["data_lost"] == 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--min-during-save", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-mode", default="disabled", choices=("disabled", "async"),
                   help="checkpoint.async_mode of the faulted runs (the reference saves sync)")
    p.add_argument("--workdir", type=Path, default=Path("outputs/chaos"))
    a = p.parse_args(argv)
    fig = run_chaos(a.workdir, faults=a.faults, min_during_save=a.min_during_save,
                    steps=a.steps, interval=a.interval, nproc=a.nproc, seed=a.seed,
                    async_mode=a.async_mode)
    print(report(fig, a.interval))
    return 0 if ok(fig, a.faults, a.min_during_save) else 1


if __name__ == "__main__":
    sys.exit(main())
