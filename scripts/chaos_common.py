"""What scripts/chaos.py and its layouts (chaos_node.py: a lost node; chaos_store.py: faults of
an object store) share: the job's arguments per layout, a launch of run_train.sh watched by a
thread, and the checkpoint folder's committed and in-progress steps, in a local folder or an
s3:// prefix (listed straight from the S3 server, not through the fault proxy)."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HANG_TIMEOUT = 5  # comm.train_timeout_seconds: what a hung rank costs


# --layout: the parallelism of the reference and the faulted runs (4 ranks for all but fsdp)
LAYOUTS = {
    "fsdp": [],
    "hsdp": ["--parallelism.data_parallel_replicate_degree", "2"],
    "tp": ["--parallelism.tensor_parallel_degree", "2"],
    "pp": ["--parallelism.pipeline_parallel_degree", "2"],
    "cp": ["--parallelism.context_parallel_degree", "2"],
    "ep": ["--model.flavor", "debugmodel-moe-narrow", "--parallelism.expert_parallel_degree", "2"],
    "s3": [],  # fsdp, its checkpoint folder on an S3 server behind a fault proxy (chaos_store.py)
}
# The model of every layout but ep (which names its own): what is checked (resumes, bitwise
# state, steps redone) does not depend on its size, and the launches, restarts and saves of a
# chaos run are most of its time; the debug model (dim 256, vocab 8,192) took ~1.5x the CPU.
MODEL = ("--model.flavor", "debugmodel-tiny", "--data.vocab_size", "1024")
# TRAINER_TEST_SAVE_HOLD (trainer/health/faults.py): every save of a chaos launch is held open
# this long, so that a fault meant for "during a save" finds one in progress: the tiny model
# saves in a few ms, less than the schedule's delay after it sees the save begin (<= 0.3 s).
SAVE_HOLD = 0.4
# TRAINER_TEST_SLOW_RANK=all:PACE in the faulted launches: every rank sleeps this long after
# each step (no straggler: all alike), so a step lasts about what the debug model's did on 2
# cores and the schedule's moments (a step count, then up to 0.6 s) fall where they did: the
# tiny model's ~20-50 ms steps would run several steps, or to the end, within one delay.
PACE = 0.25
STORE_BUCKET = "chaos"
STORE_TIMEOUT = 8.0  # checkpoint.store_timeout_seconds of the s3 layout (a loaded 2-core
# machine answers some requests in seconds: a shorter one times out requests never faulted)


def train_args(
    dump: Path,
    steps: int,
    interval: int,
    nproc: int,
    async_mode: str = "disabled",
    layout: str = "fsdp",
) -> list[str]:
    """The tiny debug model (MODEL) in fp32 on synthetic data (bitwise reproducible), in
    `layout` (LAYOUTS: its own flavor, if it names one)."""
    extra = [] if async_mode == "disabled" else ["--checkpoint.async_mode", async_mode]
    if layout == "s3":
        extra += [
            "--checkpoint.folder",
            checkpoint_of(dump, layout),
            "--checkpoint.store_timeout_seconds",
            str(STORE_TIMEOUT),
        ]
    model = MODEL[2:] if "--model.flavor" in LAYOUTS[layout] else MODEL
    return [
        *extra,
        *LAYOUTS[layout],
        "--job.dump_folder",
        str(dump),
        *model,
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        str(2 * nproc),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.min_lr_factor",
        "1.0",
        "--data.dataset",
        "synthetic",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        str(interval),
        "--checkpoint.keep_latest_k",
        "2",
        "--comm.train_timeout_seconds",
        str(HANG_TIMEOUT),
        "--health.straggler_steps",
        "3",
        "--health.max_same_failures",
        "0",  # chaos may hit one step's save again and again
        # a rank's retried requests may keep the others waiting in a save's collective
        *(["--comm.train_timeout_seconds", "60"] if layout == "s3" else []),
    ]


class Launch:
    """One run_train.sh in its own session, its output collected by a thread."""

    def __init__(self, args: list[str], nproc: int, env: dict | None = None, restarts: int = 0):
        env = dict(
            os.environ,
            NGPU=str(nproc),
            LOG_RANK="0",
            HF_DATASETS_OFFLINE="1",
            MAX_RESTARTS=str(restarts),
            **{"TRAINER_TEST_SAVE_HOLD": str(SAVE_HOLD), **(env or {})},
            PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [str(REPO / "run_train.sh"), *args],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.steps: list[int] = []
        self.resumes: list[int] = []  # per in-job restart: the step it resumed at
        self.resume_at: list[int] = []  # ... and len(steps) then
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.match(r"step:\s+(\d+)", line)
            if m:
                self.steps.append(int(m.group(1)))
            m = re.match(r"restart \d+ of at most .*; resuming at step (\d+)$", line)
            if m:
                self.resume_at.append(len(self.steps))
                self.resumes.append(int(m.group(1)))

    def attempt_steps(self) -> list[int]:
        return self.steps[self.resume_at[-1] :] if self.resume_at else self.steps

    def attempt_start(self) -> int | None:
        """The step the running attempt resumed from (None before it logged a step)."""
        steps = self.attempt_steps()
        if not steps:
            return None
        return self.resumes[-1] if self.resume_at else steps[0] - 1

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


def checkpoint_of(dump: Path, layout: str = "fsdp") -> Path | str:
    """The checkpoint folder of a run: `dump/checkpoint`, or for the s3 layout an s3:// prefix
    of its own (named after the dump folder)."""
    if layout != "s3":
        return Path(dump) / "checkpoint"
    tag = hashlib.blake2b(str(Path(dump).resolve()).encode(), digest_size=6).hexdigest()
    return f"s3://{STORE_BUCKET}/{Path(dump).name}-{tag}"


def _step_folders(url: str) -> dict[str, tuple[int, dict[str, float]]]:
    """{prefix: (N, {object name: its mtime})} of the step-N and step-N.K prefixes under an
    s3:// prefix (trainer/checkpoint/steps.py: a step re-saved after a rewind is written to a
    fresh step-N.K)."""
    import boto3

    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    out: dict[str, tuple[int, dict[str, float]]] = {}
    pages = (
        boto3.client("s3")
        .get_paginator("list_objects_v2")
        .paginate(Bucket=bucket, Prefix=prefix + "/")
    )
    for page in pages:
        for obj in page.get("Contents", []):
            folder, _, name = obj["Key"][len(prefix) + 1 :].partition("/")
            m = re.fullmatch(r"step-(\d+)(?:\.\d+)?", folder)
            if m and name:
                out.setdefault(folder, (int(m.group(1)), {}))[1][name] = obj[
                    "LastModified"
                ].timestamp()
    return out


def committed(ckpt: Path | str) -> list[int]:
    """The committed steps: `step-N` folders (local), steps with a manifest (s3://)."""
    if isinstance(ckpt, str):
        return sorted({n for n, names in _step_folders(ckpt).values() if "manifest.json" in names})
    return sorted(int(p.name[5:]) for p in ckpt.glob("step-*") if re.fullmatch(r"step-\d+", p.name))


def partials(ckpt: Path | str) -> set[tuple[str, int]]:
    """The saves in progress or cut off: (`step-N.partial`, an id of that attempt); on a store
    the prefixes with neither a manifest nor a set-aside one (manifest.<reason>.json)."""
    if isinstance(ckpt, str):
        return {
            (f"step-{n}.partial", int(min(names.values()) * 1e6))
            for n, names in _step_folders(ckpt).values()
            if not any(o.startswith("manifest.") for o in names)
        }
    out = set()
    for p in ckpt.glob("step-*.partial"):
        try:
            out.add((p.name, p.stat().st_ino))
        except OSError:
            pass
    return out


def ino(ckpt: Path | str, step: int) -> int | None:
    """An id of the committed folder `step-N` (its inode; 0 on a store: never damaged)."""
    if isinstance(ckpt, str):
        return 0
    try:
        return (ckpt / f"step-{step}").stat().st_ino
    except OSError:
        return None
