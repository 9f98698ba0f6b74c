"""Fault injection: every testing hook of the trainer, read once at start-up (`arm`).

Tests and the chaos runs (scripts/chaos.py) set these variables to make one rank fail in one
way at one step; nothing happens unless one is set. The step calls one hook per phase
(`step_start`, `first_forward`, `loss`, `step_end`); the checkpointer calls `save_writer` and
`before_commit`.

- TRAINER_TEST_FAULT="KIND:RANK:STEP[:ATTEMPT],...": KIND hang (the rank SIGSTOPs itself) or
  kill (SIGKILL) at the start of STEP, on every attempt or only on restart attempt ATTEMPT.
- TRAINER_TEST_NAN_LOSS="RANK:STEP,STEP,...": that rank's loss is NaN at those steps (after
  backward, so only the guard sees it), e.g. 1:3,4.
- TRAINER_TEST_SPIKE_LOSS="RANK:STEP,STEP,...:FACTOR": that rank's loss times FACTOR (after
  backward: the guard and the logs see it, the gradients do not) when a step trains on the
  global batch that starts at sample (STEP - 1) x global batch size, i.e. step STEP's data in a
  run with a fixed batch that passes over nothing. The spike lives in that data: a step that
  passes over it does not meet it again. E.g. 1:6:20.
- TRAINER_TEST_OOM="RANKS:STEP[:GIB]" (RANKS comma-separated): those ranks raise
  torch.OutOfMemoryError after the forward of the step's first microbatch; GIB stands in for
  the device's memory in the advice (on CPU there is none to read).
- TRAINER_TEST_SLOW_RANK="RANK:SECONDS[:PATH]": that rank (RANK "all": every rank, a pace
  rather than a straggler) sleeps after every optimizer step; with PATH, only while the file
  PATH exists (a test removes it to let the run finish).
- TRAINER_TEST_SAVE_ERROR="STEP:ERRNO[:RANK]": that rank's save at STEP fails with OSError
  ERRNO (default rank 0), like a broken or full disk.
- TRAINER_TEST_SAVE_HOLD="SECONDS": every rank holds each save open that long (half before
  writing its files, half after), like a slow disk: the chaos runs' tiny model saves in a few
  ms, and their "during a save" faults need a save in progress to land in.
- TRAINER_TEST_CRASH_BEFORE_COMMIT="STEP": rank 0 dies (exit 17) after writing the save of
  STEP and before committing it.
- TRAINER_TEST_COLLECTIVE_TIMEOUT="SECONDS": the process groups' timeout during training,
  instead of comm.train_timeout_seconds (which the heartbeat's own watch keeps): a collective
  that never raises in time, as when nccl's watchdog would abort the process first.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field

FAULT_ENV = "TRAINER_TEST_FAULT"
NAN_ENV = "TRAINER_TEST_NAN_LOSS"
SPIKE_ENV = "TRAINER_TEST_SPIKE_LOSS"
OOM_ENV = "TRAINER_TEST_OOM"
SLOW_ENV = "TRAINER_TEST_SLOW_RANK"
SAVE_ERROR_ENV = "TRAINER_TEST_SAVE_ERROR"
SAVE_HOLD_ENV = "TRAINER_TEST_SAVE_HOLD"
CRASH_ENV = "TRAINER_TEST_CRASH_BEFORE_COMMIT"
COLLECTIVE_TIMEOUT_ENV = "TRAINER_TEST_COLLECTIVE_TIMEOUT"


@dataclass
class Faults:
    """The faults asked of this rank; empty (no-ops) unless a variable names it."""

    stops: list[tuple[int, int, int | None]] = field(
        default_factory=list
    )  # (signal, step, attempt)
    nan_steps: frozenset[int] = frozenset()
    spike_steps: frozenset[int] = frozenset()
    spike_factor: float = 1.0
    oom_step: int | None = None
    device_gib: float = 0.0  # the device memory an injected OOM's advice assumes
    delay_s: float = 0.0
    delay_gate: str = ""  # the file whose removal ends the delays ("": none)
    save_error: tuple[int, int] | None = None  # (step, errno)
    save_hold_s: float = 0.0  # seconds each save is held open
    crash_before_commit: int | None = None
    collective_timeout_s: float = 0.0  # 0: the training timeout
    _spike_now: float = 1.0  # the factor of the step in flight

    @classmethod
    def from_env(cls, env=os.environ) -> "Faults":
        rank, f = env.get("RANK", "0"), cls()
        for spec in filter(None, env.get(FAULT_ENV, "").split(",")):
            kind, r, at, *when = spec.split(":")
            if r == rank:
                f.stops.append(
                    (
                        signal.SIGSTOP if kind == "hang" else signal.SIGKILL,
                        int(at),
                        int(when[0]) if when else None,
                    )
                )
        r, _, steps = env.get(NAN_ENV, "").partition(":")
        if steps and r == rank:
            f.nan_steps = frozenset(int(s) for s in steps.split(","))
        if env.get(SPIKE_ENV):
            r, steps, factor = env[SPIKE_ENV].split(":")
            if r == rank:
                f.spike_steps, f.spike_factor = (
                    frozenset(int(s) for s in steps.split(",")),
                    float(factor),
                )
        spec = env.get(OOM_ENV, "").split(":")
        if len(spec) >= 2:
            f.device_gib = float(spec[2]) if len(spec) > 2 else 0.0
            if rank in spec[0].split(","):
                f.oom_step = int(spec[1])
        spec = env.get(SLOW_ENV, "").split(":", 2)
        if len(spec) >= 2 and spec[0] in (rank, "all"):
            f.delay_s, f.delay_gate = float(spec[1]), spec[2] if len(spec) > 2 else ""
        spec = env.get(SAVE_ERROR_ENV, "").split(":")
        if len(spec) >= 2 and int(spec[2] if len(spec) > 2 else 0) == int(rank):
            f.save_error = (int(spec[0]), int(spec[1]))
        f.save_hold_s = float(env.get(SAVE_HOLD_ENV) or 0)
        if env.get(CRASH_ENV) and rank == "0":
            f.crash_before_commit = int(env[CRASH_ENV])
        f.collective_timeout_s = float(env.get(COLLECTIVE_TIMEOUT_ENV) or 0)
        return f

    # -- the step's phases --
    def step_start(self, step: int, loader) -> None:
        """Stop or kill this rank if asked; note the spike factor of the global batch `loader`
        delivers next (call before the step fetches it; a loader without a global order never
        matches)."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        for signum, at, when in self.stops:
            if at == step and (when is None or when == restart):
                os.kill(os.getpid(), signum)
        consumed = getattr(loader, "consumed", None)
        self._spike_now = (
            self.spike_factor
            if consumed is not None
            and any(consumed == (s - 1) * loader.global_batch_size for s in self.spike_steps)
            else 1.0
        )

    def first_forward(self, step: int) -> None:
        """After the forward of the step's first microbatch: an out-of-memory error if asked."""
        if self.oom_step == step:
            import torch

            raise torch.OutOfMemoryError(f"{OOM_ENV}: injected at step {step}")

    def loss(self, step: int, loss_sum):
        """The step's summed loss as the guard and the logs see it (the gradients are done)."""
        if self._spike_now != 1.0:
            loss_sum = loss_sum * self._spike_now
        if step in self.nan_steps:
            loss_sum = loss_sum + math.nan
        return loss_sum

    def step_end(self) -> None:
        """After the optimizer step: a slow rank sleeps here (while its gate file exists)."""
        if not self.delay_s:
            return
        if not self.delay_gate:
            time.sleep(self.delay_s)
            return
        deadline = time.monotonic() + self.delay_s
        while os.path.exists(self.delay_gate) and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- the checkpointer's --
    def save_fails(self, step: int) -> int | None:
        """The errno this rank's save at `step` fails with, or None."""
        return self.save_error[1] if self.save_error and self.save_error[0] == step else None

    def before_commit(self, step: int) -> None:
        if self.crash_before_commit == step:
            os._exit(17)


_armed = Faults()


def arm(env=os.environ) -> Faults:
    """Read the variables once (at start-up); every hook after this uses what was read."""
    global _armed
    _armed = Faults.from_env(env)
    return _armed


def armed() -> Faults:
    return _armed
