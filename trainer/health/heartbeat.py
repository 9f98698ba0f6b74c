"""Hung ranks found and named: a heartbeat per rank in the rendezvous store, read when a
collective times out.

    training error: rank 1 stopped responding at step 3 (FSDP all-gather in forward; no answer
    for 15 s); its last heartbeat said step 3, backward; host node7, pid 4242

A collective that a rank never joins (the process stopped, a GPU that no longer answers, a
network partition) fails on its healthy peers only when the collective timeout fires
(`comm.train_timeout_seconds`), and gloo's error ("Timed out waiting 15000ms for recv") names
no one. So each rank keeps, in memory, the step and phase of the loop it is in (`phase()`:
free, no I/O), and a daemon thread publishes them every `health.heartbeat_seconds` to the
torchrun agent's store (the c10d TCPStore the ranks met through: it lives in the launcher, not
in a rank) with a beat counter. The first rank whose collective timed out (an atomic counter
in the store) reads every rank's entry twice, `STALE_BEATS` beats apart, in one batched read
each (`multi_get`): a rank whose counter
did not move stopped responding (the whole process is stopped, dead or cut off); one that
still beats but whose loop is behind ours (fewer phases entered) did not arrive (its main
thread is stuck). That rank prints the one line while the others wait for it; every healthy
rank exits with HANG_EXIT_CODE without tearing down the process group (a peer is gone). The
launcher SIGKILLs a stopped rank at once (trainer/launch.py) rather than waiting 30 s for it
to obey SIGTERM.

On CUDA the same heartbeat names the rank; nccl's own watchdog aborts the communicator after
the timeout, and its flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and
TORCH_NCCL_DUMP_ON_TIMEOUT=1, set by run_train.sh and the SLURM script unless already set)
dumps each rank's last collectives on a timeout to TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>
(default /tmp/nccl_trace_rank_<rank>, on each node); read them with
`torchfrtrace` (`python -m torch.distributed.flight_recorder.fr_trace`). On one H100 a dump
under these settings reads back (benchmarks/gpu/gpu_flight_recorder.py); a cross-rank hang needs
two GPUs and has not been run.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from trainer.errors import HANG_EXIT_CODE
from trainer.health.restarts import attempt, record_failure

STALE_BEATS = 2.5  # beats without a change that make a rank stale
PHASES = {
    "setup": "setup",
    "step_start": "token-count all-reduce at the step's start",
    "forward": "FSDP all-gather in forward",
    "backward": "gradient reduce-scatter in backward",
    "tp_grads": "MoE gradient all-reduce over tp",
    "clip": "clip all-reduce",
    "step_end": "step-end all-reduce",
    "log": "loss all-reduce for logging",
    "checkpoint": "checkpoint",
    "validation": "validation",
    "eval": "evals",
}
_state = {
    "step": 0,
    "phase": "setup",
    "seq": 0,
    "timeout": 0.0,
    "beat_s": 1.0,
    "moved": time.monotonic(),
    "watch_s": 0.0,
}
# The phases the watch covers: a step's compute and collectives. Setup, saves, validation and
# evals may legitimately run longer than the training timeout without a collective waiting.
WATCHED = ("step_start", "forward", "backward", "tp_grads", "clip", "step_end", "log")
# A peer that died: the collective fails at once, with one of these messages.
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "communicator was aborted",
)
PEER_LOST_GRACE_S = 2.0  # the launcher names the rank that ended first: let it see the dead one


def phase(name: str, step: int | None = None) -> None:
    """The loop enters `name` (a key of PHASES), at `step` if given. Costs a dict update."""
    _state["phase"] = name
    _state["seq"] += 1
    _state["moved"] = time.monotonic()
    if step is not None:
        _state["step"] = step


def watch(seconds: float) -> None:
    """Arm the heartbeat thread's own watch (after step 1): when this rank's loop has not moved
    for `seconds` plus STALE_BEATS beats in a step's phase, and a peer's heartbeat stopped or
    its loop is behind, the thread reports the hang and exits with HANG_EXIT_CODE, without
    waiting for a collective to raise (nccl's watchdog may abort the process first)."""
    _state["watch_s"] = seconds


def note_timeout(seconds: float) -> None:
    """The collective timeout now in force (named in the report)."""
    _state["timeout"] = seconds


def _key(rank: int) -> str:
    return f"trainer/heartbeat/{attempt()}/{rank}"


class Heartbeat:
    """The publishing thread; `start()` after the process group exists."""

    def __init__(self, seconds: float):
        self.seconds = _state["beat_s"] = seconds
        self.beats = 0
        self._watcher: bool | None = None  # decided when this rank is first stuck
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trainer-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        if self.seconds > 0 and dist.is_initialized():
            self.store, self.rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
            self._beat()
            self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        self.beats += 1
        entry = {
            "beat": self.beats,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": _state["step"],
            "phase": _state["phase"],
            "seq": _state["seq"],
        }
        self.store.set(_key(self.rank), json.dumps(entry))

    def _run(self) -> None:
        seen = None  # (every rank's entry, when) at the last look while stuck
        while not self._stop.wait(self.seconds):
            try:
                self._beat()
                seen = self._watch(seen)
            except Exception:  # the store is gone (the launcher ended): nothing to tell
                return

    def _is_watcher(self) -> bool:
        """The first rank of this attempt to get stuck reads the heartbeats (an atomic counter
        in the store); the others leave the store alone: W stuck ranks would read W entries
        each, twice, every few beats."""
        if self._watcher is None:
            self._watcher = claim_report("watch")
        return self._watcher

    def _watch(self, seen):
        """Look at the peers once this rank is stuck (every STALE_BEATS beats, so the store is
        read only then); report a hang that a peer's heartbeat confirms."""
        now, limit = time.monotonic(), _state["watch_s"]
        stuck = (
            limit > 0
            and _state["phase"] in WATCHED
            and now - _state["moved"] > limit + STALE_BEATS * self.seconds
        )
        if not stuck:
            return None
        if seen is not None and now - seen[1] < STALE_BEATS * self.seconds:
            return seen
        if not self._is_watcher():  # one stuck rank reads the store for all of them
            return None
        entries = read_all(dist.get_world_size())
        if seen is None:
            return entries, now
        stopped, behind = judge(seen[0], entries, self.rank)
        if not stopped and not behind:  # every rank is slow alike (e.g. a recompile)
            return entries, now
        _state["timeout"] = round(now - _state["moved"])
        if claim_report("hang"):
            line = report_line(stopped, behind, entries)
            record_failure("hang", stopped + behind, _state["step"], line)
            print(line, file=sys.stderr, flush=True)
        else:  # the reporting rank may still be reading: keep beating a little
            for _ in range(int(STALE_BEATS) + 2):
                self._beat()
                time.sleep(self.seconds)
        sys.stdout.flush()
        os._exit(HANG_EXIT_CODE)


def is_timeout(exc: BaseException) -> bool:
    """A collective that timed out (gloo's and nccl's messages)."""
    text = str(exc)
    return "Timed out" in text or "timed out" in text or "Watchdog caught" in text


def read_all(world: int) -> dict[int, dict | None]:
    """Every rank's last entry: one batched read of the store when every rank has beaten
    (the usual case), else one check and read per rank (a rank that never beat is None)."""
    store, keys = dist.distributed_c10d._get_default_store(), [_key(r) for r in range(world)]
    try:
        if store.check(keys):
            return {r: json.loads(v) for r, v in enumerate(store.multi_get(keys))}
    except Exception:
        pass
    out = {}
    for rank, key in enumerate(keys):
        try:
            out[rank] = json.loads(store.get(key)) if store.check([key]) else None
        except Exception:
            out[rank] = None
    return out


def missing_ranks(seconds: float) -> tuple[list[int], list[int], dict]:
    """(stopped: heartbeat not moving, behind: beating but their loop behind this rank's),
    and the last entries read."""
    world = dist.get_world_size()
    first = read_all(world)
    time.sleep(STALE_BEATS * seconds)
    last = read_all(world)
    return (*judge(first, last, dist.get_rank()), last)


def judge(first: dict, last: dict, me: int) -> tuple[list[int], list[int]]:
    """(ranks whose heartbeat did not move between two reads, ranks that beat but whose loop
    is behind this rank's)."""
    stopped = [
        r
        for r in last
        if r != me and (last[r] is None or first[r] is None or last[r]["beat"] == first[r]["beat"])
    ]
    behind = [r for r in last if r != me and r not in stopped and last[r]["seq"] < _state["seq"]]
    return stopped, behind


def report_line(stopped: list[int], behind: list[int], entries: dict) -> str:
    """The one line: who, at which step and phase, and the timeout that fired."""
    where = (
        f"at step {_state['step']} ({PHASES.get(_state['phase'], _state['phase'])}; "
        f"no answer for {_state['timeout']:g} s)"
    )
    parts = []
    for ranks, what in ((stopped, "stopped responding"), (behind, "did not arrive")):
        if ranks:
            who = ", ".join(str(r) for r in ranks)
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {who} {what} {where}")
    if not parts:
        return (
            f"training error: a collective timed out {where}; every rank's heartbeat "
            "is current (a slow collective? raise comm.train_timeout_seconds)"
        )
    first = entries.get((stopped or behind)[0])
    last = (
        ""
        if not first
        else (
            f"; its last heartbeat said step {first['step']}, {first['phase']}; host "
            f"{first['host']}, pid {first['pid']}"
        )
    )
    return f"training error: {'; '.join(parts)}{last}"


def claim_report(what: str) -> bool:
    """True on the first rank to report `what` in this attempt."""
    store = dist.distributed_c10d._get_default_store()
    try:
        return store.add(f"trainer/report/{attempt()}/{what}", 1) == 1
    except Exception:
        return dist.get_rank() == 0


def collective_failure(exc: BaseException) -> int | None:
    """The exit code after a collective failed with `exc` (one rank prints one line, and
    records the failure for the restart guard), or None if `exc` is no collective's failure."""
    if not dist.is_initialized() or not isinstance(exc, RuntimeError):  # gloo's and nccl's
        return None
    if is_timeout(exc):
        beat = _state["beat_s"] or 1.0
        if claim_report("hang"):  # one rank reads the heartbeats (2 x world store reads)
            stopped, behind, entries = missing_ranks(beat)
            line = report_line(stopped, behind, entries)
            record_failure("hang", stopped + behind, _state["step"], line)
            print(line, file=sys.stderr, flush=True)
        else:  # the others wait for it: their exit makes the launcher stop every rank
            time.sleep(STALE_BEATS * beat + 1.0)
        return HANG_EXIT_CODE
    if any(text in str(exc) for text in PEER_LOST):
        if claim_report("lost"):  # the launcher names the rank that ended
            record_failure(
                "lost",
                [],
                _state["step"],
                f"training error: a rank ended at step "
                f"{_state['step']} ({PHASES.get(_state['phase'], _state['phase'])})",
            )
        time.sleep(PEER_LOST_GRACE_S)
        return 1
    return None


def record_crash(exc: BaseException) -> None:
    """Any other error (its traceback is printed): recorded for the restart guard."""
    if dist.is_initialized():
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        record_failure(
            "error",
            [dist.get_rank()],
            _state["step"],
            f"training error: rank {dist.get_rank()} failed at step {_state['step']} "
            f"({PHASES.get(_state['phase'], _state['phase'])}): {text}",
        )


def current() -> dict:
    return dict(_state)
