"""Run the real product from tests: run_train.sh, torchrun'd scripts, and read what users read."""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_TRAIN = REPO / "run_train.sh"

# Multi-rank tests ask for CPU ranks explicitly, so they run the same on a machine with GPUs
# (where "auto" would put NGPU ranks on fewer GPUs than that).
CPU = ["--training.device", "cpu"]

# The synthetic token stream at a 1,024-token vocab: at dim 64 the embedding and the output
# projection are most of a tiny model (2 x 8,192 x 64 of debugmodel-tiny's 1.15M weights at
# data.vocab_size's default), so its steps, all-gathers and saves are mostly the vocab's: a
# 4-rank step ~52 -> ~38 CPU-ms a rank (docs/development.md). Still twice the 512 tokens the
# stream visits (trainer/data/synthetic.py), so a model learns which ones first.
SYNTHETIC = ("--data.dataset", "synthetic", "--data.vocab_size", "1024")
# DataConfig's default vocab (tests/test_data_order.py checks it): the cached stdlib tokenizer's,
# which the suite's stores are cut with. A test that trains on the stdlib corpus after
# SYNTHETIC's settings puts it back with STDLIB; one that needs the debug model's own vocab
# (a memory fit) with STDLIB_VOCAB.
STDLIB_VOCAB = ("--data.vocab_size", "8192")
STDLIB = ("--data.dataset", "stdlib", *STDLIB_VOCAB)

# Small, fast settings shared by the end-to-end tests (debugmodel-tiny: a 2-layer, dim-64
# slice of the debug model; a test that needs the debug shape names its flavor after these).
TINY = [
    *CPU,
    "--model.flavor",
    "debugmodel-tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    *SYNTHETIC,
]


# fp32, a fixed global batch of 8 sequences, constant lr after warmup (so a run that stops at
# step 4 has the same schedule as one that goes on to 8).
BASE_FP32 = [*TINY, "--training.global_batch_size", "8", "--lr_scheduler.min_lr_factor", "1.0"]


def subprocess_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)  # run_train.sh's interpreter: the one running tests
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a hung launch's stacks (run_or_dump_stacks)
    env["PYTHONPATH"] = str(REPO) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    for key, value in (extra or {}).items():  # None removes a variable
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


# The launcher zygote (tests/scripts/zygote.py): run_train's CPU launches fork from one process
# per pytest worker that imported torch and the trainer once, instead of starting Python and
# importing anew (~3-6 CPU-s a launch). run_train.sh runs unchanged; its interpreter is the shim.
# On for every test file (the whole suite runs green with it); TRAINER_TEST_ZYGOTE=0
# for none. Environment a launch is given that torch may read at import (TORCH_*, OMP_*, ...)
# sends that launch through the real interpreter.
ZYGOTE_OFF = {"0", "off", "false", "no"}
ZYGOTE_UNSAFE_ENV = ("TORCH", "OMP_", "MKL_", "KMP_", "CUDA", "PYTORCH", "LD_", "PYTHON", "GLOO")
# ... except the ranks' thread count, which each rank sets itself (trainer/launch.py), and
# inductor's cache folder, which it reads at each compile (the zygote compiles nothing)
ZYGOTE_SAFE_ENV = ("OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR")
_zygote: dict = {}


def zygote_env(env: dict | None) -> dict:
    """The environment that sends a run_train launch through the zygote (started on first
    use), or {} where it must start as a fresh interpreter."""
    mode = os.environ.get("TRAINER_TEST_ZYGOTE", "on").strip().lower()
    if mode in ZYGOTE_OFF or any(
        k.startswith(ZYGOTE_UNSAFE_ENV) and k not in ZYGOTE_SAFE_ENV for k in (env or {})
    ):
        return {}
    if _zygote.get("pid") != os.getpid():  # none yet in this process (or a fork's copy)
        import atexit
        import tempfile

        folder = tempfile.mkdtemp(prefix="trainer-zygote-")
        sock, wrapper = os.path.join(folder, "socket"), os.path.join(folder, "python")
        with open(wrapper, "w") as fh:  # run_train.sh execs "$PYTHON": one executable path
            fh.write(
                f"#!/bin/sh\nexec {sys.executable} -S "
                f'{REPO / "tests" / "scripts" / "zygote_shim.py"} "$@"\n'
            )
        os.chmod(wrapper, 0o755)
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "scripts" / "zygote.py"), sock],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise AssertionError("tests/scripts/zygote.py did not start")
        atexit.register(lambda: (proc.terminate(), proc.wait(), shutil.rmtree(folder, True)))
        _zygote.update(pid=os.getpid(), socket=sock, wrapper=wrapper, server=proc.pid)
        os.environ["TRAINER_TEST_CPU_LEDGER"] = sock + ".cpu"  # tests/budget.py's
    return {
        "PYTHON": _zygote["wrapper"],
        "TRAINER_TEST_ZYGOTE_SOCKET": _zygote["socket"],
        "TRAINER_TEST_ZYGOTE_PYTHON": os.environ.get("PYTHON", sys.executable),
    }


def fork_python(env: dict | None = None) -> tuple[str, dict]:
    """(interpreter, environment) for a test's `python -m MODULE ...` or `python SCRIPT.py ...`
    that need not start a fresh interpreter (a CLI's run, a probe's launcher): the zygote's
    shim, which forks it from the process that imported torch and the trainer once (~3-6 CPU-s
    less each); the real interpreter where zygote_env says a fresh one is needed. `env`: extra
    variables, as subprocess_env takes them. A test of what a fresh process imports or prints
    at its start runs sys.executable instead."""
    forked = zygote_env(env)
    return forked.get("PYTHON", sys.executable), subprocess_env({**forked, **(env or {})})


def children_cpu() -> float:
    """CPU seconds of this process's ended launches (its waited-for children, the zygote's)."""
    import resource

    from tests.budget import launched_cpu

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime + launched_cpu()


def log_launch(
    kind: str, nproc, seconds: float, stdout: str, cpu_from: float | None = None
) -> None:
    """With TRAINER_TEST_LAUNCH_LOG=FILE: one JSON line per launch (the test, its kind, ranks,
    seconds, CPU seconds since children_cpu() was `cpu_from`, the steps and saves its rank-0
    output shows) appended to FILE, to see where a suite's time goes (docs/development.md)."""
    path = os.environ.get("TRAINER_TEST_LAUNCH_LOG")
    if not path:
        return
    import json

    record = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "kind": kind,
        "nproc": nproc,
        "seconds": round(seconds, 2),
        "cpu_s": None if cpu_from is None else round(children_cpu() - cpu_from, 2),
        "steps": len(re.findall(r"^step: ", stdout or "", re.M)),
        "saves": len(re.findall(r"^saved checkpoint", stdout or "", re.M)),
    }
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def run_train(
    dump: Path | str,
    *overrides: str,
    nproc: int | None = 2,
    env: dict | None = None,
    config: str | None = None,
    timeout: float = 300,
    check: bool = True,
    log_rank: str = "0",
    device: str | None = "cpu",
) -> subprocess.CompletedProcess:
    """`NGPU=nproc ./run_train.sh --training.device cpu --job.dump_folder dump <overrides>`;
    returns the completed run. `nproc=None` leaves NGPU unset; `device=None` leaves the
    config's device (auto). CPU launches start from the launcher zygote (zygote_env)."""
    extra = {"LOG_RANK": log_rank, **(zygote_env(env) if device == "cpu" else {}), **(env or {})}
    if nproc is not None:
        extra["NGPU"] = str(nproc)
    if config:
        extra["CONFIG_FILE"] = config
    first = ["--training.device", device] if device else []
    start, cpu = time.monotonic(), children_cpu()
    proc = run_or_dump_stacks(
        [str(RUN_TRAIN), *first, "--job.dump_folder", str(dump), *overrides],
        env=subprocess_env(extra),
        timeout=timeout,
    )
    log_launch("run_train", nproc, time.monotonic() - start, proc.stdout, cpu)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"run_train.sh exited {proc.returncode}\n--- stdout\n"
            f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def run_or_dump_stacks(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output, text, timeout), except that a launch past its timeout
    is first asked for its stacks: SIGABRT to each of its processes (its launcher and ranks,
    forked from the zygote or started from cmd), whose faulthandler (torchrun's elastic agent
    enables it in the launcher and the ranks; PYTHONFAULTHANDLER from subprocess_env in any
    other interpreter) prints every thread's Python stack to the launch's stderr; the
    LaunchTimeout's message ends with that output, so a hung launch names where it hung."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if env.get("PYTHON") == _zygote.get("wrapper") and _zygote.get("pid") == os.getpid():
            # proc is the shim; the zygote's handlers (its children) wait for the launches below
            launch = [p for h in children(_zygote["server"]) for p in process_tree(h)[1:]]
        else:
            launch = process_tree(proc.pid)  # run_train.sh execs the launcher
        for pid in launch:  # one at a time: the dumps share the launch's stderr
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
            time.sleep(0.2)
        time.sleep(1)  # the dumps are written (in the signal handler), the processes die of them
        proc.kill()
        out, err = proc.communicate()
        raise LaunchTimeout(
            cmd,
            timeout,
            output=out,
            stderr=f"{err}\n[{len(launch)} processes of the launch sent SIGABRT "
            f"for their stacks, above]",
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class LaunchTimeout(subprocess.TimeoutExpired):
    """A TimeoutExpired whose message ends with the launch's output: its stacks."""

    def __str__(self) -> str:
        return (
            f"{super().__str__()}\n--- stdout\n{(self.stdout or '')[-3000:]}\n"
            f"--- stderr (the stacks)\n{(self.stderr or '')[-12000:]}"
        )


def run_train_watched(
    dump: Path | str, *overrides: str, mark: str, timeout: float = 300, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    """run_train (2 CPU ranks, not checked) that also returns how many seconds the run went on
    after its stdout first matched the regex `mark` (e.g. step 1's line): a bound on what
    follows it that a loaded machine's slow launch (imports, rendezvous) does not eat into.
    The whole run if `mark` never shows."""
    import threading

    extra = {"LOG_RANK": "0", "NGPU": "2", **(env or {})}
    proc = subprocess.Popen(
        [str(RUN_TRAIN), *CPU, "--job.dump_folder", str(dump), *overrides],
        env=subprocess_env(extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0, cpu = time.monotonic(), children_cpu()
    seen, out, err = [t0], [], []

    def read_out():
        for line in proc.stdout:
            if len(seen) == 1 and re.search(mark, line):
                seen.append(time.monotonic())
            out.append(line)

    readers = [
        threading.Thread(target=read_out),
        threading.Thread(target=lambda: err.extend(proc.stderr)),
    ]
    for r in readers:
        r.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in readers:
            r.join()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out), "".join(err))
    log_launch("run_train_watched", 2, time.monotonic() - t0, done.stdout, cpu)
    return done, time.monotonic() - seen[-1]


def torchrun(
    script: Path | str,
    *args: str,
    nproc: int = 2,
    timeout: float = 300,
    env: dict | None = None,
    fork: bool = False,
) -> subprocess.CompletedProcess:
    """Run a Python script under real torchrun (c10d rendezvous on a free localhost port);
    `fork`: its `main(argv)` on ranks forked from a launcher that imported torch and the
    trainer once (tests/scripts/forkrun.py: the same agent, ~4 s less per rank)."""
    python, run_env = fork_python(env) if fork else (sys.executable, subprocess_env(env))
    if fork:  # forkrun.py's own imports: forked from the zygote too
        cmd = [
            python,
            str(REPO / "tests" / "scripts" / "forkrun.py"),
            str(nproc),
            str(script),
            *args,
        ]
    else:
        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc_per_node",
            str(nproc),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "localhost:0",
            str(script),
            *args,
        ]
    start, cpu = time.monotonic(), children_cpu()
    proc = run_or_dump_stacks(cmd, run_env, timeout)  # a hung probe says where (LaunchTimeout)
    log_launch(f"torchrun {Path(script).name}", nproc, time.monotonic() - start, proc.stdout, cpu)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} exited {proc.returncode}\n--- stdout\n"
            f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def probe_cases_argv(cases: dict[str, list[str]], *common: str) -> list[str]:
    """Probe arguments for several cases in one launch: `NAME common overrides -- NAME ...`."""
    argv: list[str] = []
    for name, overrides in cases.items():
        argv += [*(["--"] if argv else []), name, *common, *overrides]
    return argv


def run_probe_cases(argv: list[str], probe) -> None:
    """In a probe script: `argv` = OUT_DIR then cases as probe_cases_argv writes them; calls
    probe(OUT_DIR/NAME, overrides) for each case, in order."""
    out_dir, current = argv[0], []
    for arg in [*argv[1:], "--"]:
        if arg == "--":
            probe(os.path.join(out_dir, current[0]), current[1:])
            current = []
        else:
            current.append(arg)


def scalars(dump: Path | str, tag: str, tb_folder: str = "tb") -> dict[int, float]:
    """{step: value} of one TensorBoard tag across every run folder under the dump folder
    (later runs, e.g. a resume, overwrite earlier values of the same step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    runs = sorted(
        {
            os.path.dirname(p)
            for p in glob.glob(
                os.path.join(str(dump), tb_folder, "**", "events.out.tfevents.*"), recursive=True
            )
        },
        key=os.path.getmtime,
    )
    for run in runs:
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def stopped_after_save(run: Path, dest: Path, dropped_step: int) -> Path:
    """A copy of a finished run as if it had stopped before saving `dropped_step`: that
    checkpoint and every TensorBoard event are removed, so what is logged next is the rerun's."""
    shutil.copytree(run, dest)
    shutil.rmtree(dest / "checkpoint" / f"step-{dropped_step}")
    shutil.rmtree(dest / "tb")
    return dest


def losses(dump: Path | str) -> dict[int, float]:
    return scalars(dump, "loss_metrics/global_avg_loss")


def global_batches(stdout: str, what: str = "samples") -> list[list[str]]:
    """Per step, the whole global batch in dp-rank order from the TRAINER_DEBUG_DATA_HASHES
    lines of every rank: the sample hashes (`samples`) or a blend's source/epoch/window ids
    (`sources`); each rank prints one line of each per step."""
    per_rank: dict[int, list[list[str]]] = {}
    for dp_rank, items in re.findall(rf"^data dp_rank (\d+) {what} (\S+)$", stdout, re.M):
        per_rank.setdefault(int(dp_rank), []).append(items.split(","))
    steps = len(per_rank[0])
    assert all(len(v) == steps for v in per_rank.values())
    return [sum((per_rank[r][s] for r in sorted(per_rank)), []) for s in range(steps)]


# --------------------------------------------------------------------------- W&B run files

WANDB_SKIP = "wandb is not installed (pip install -e '.[wandb]'; CI installs it with .[dev])"


def wandb_or_skip():
    """The wandb module; skips the test without it, except under CI (CI=true), which installs
    it and so must not silently skip."""
    import pytest

    if os.environ.get("CI"):
        import wandb

        return wandb
    return pytest.importorskip("wandb", reason=WANDB_SKIP)


def wandb_offline_env(tmp: Path | str) -> dict:
    """Environment changes (None = unset) for an offline W&B run that reads none of the
    caller's WANDB_* settings and writes nothing outside `tmp` (wandb-core's debug logs and
    settings would go to ~/.cache/wandb and ~/.config/wandb)."""
    env: dict = {key: None for key in os.environ if key.startswith("WANDB_")}
    env.update(
        WANDB_MODE="offline",
        WANDB_CACHE_DIR=os.path.join(str(tmp), "wandb_cache"),
        WANDB_CONFIG_DIR=os.path.join(str(tmp), "wandb_config"),
        WANDB_DATA_DIR=os.path.join(str(tmp), "wandb_data"),
    )
    return env


def wandb_launches(root: Path | str) -> list[dict]:
    """Every W&B launch whose run files are under `root` (e.g. `{dump}/wandb`), by start time:
    {"id", "config" (nested), "history" (the logged rows, wandb's `_*` keys dropped),
    "exit_code" (None if the run did not finish), "preempting"}.

    Read from the `run-<id>.wandb` transaction logs that online and offline runs both write:
    records framed as in LevelDB's log format (wandb's own, stable since 0.10) holding
    `wandb.proto.wandb_internal_pb2.Record` protobufs. Not through wandb's private reader,
    which newer versions dropped (`wandb.sdk.internal.datastore`), nor `wandb leet inspect`,
    which older ones lack."""
    import json

    out = []
    for path in glob.glob(os.path.join(str(root), "*run-*", "run-*.wandb")):
        launch = {
            "id": None,
            "config": {},
            "history": [],
            "exit_code": None,
            "preempting": False,
            "start": 0,
            "path": path,
        }
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                launch["id"] = record.run.run_id
                launch["start"] = record.run.start_time.ToNanoseconds()
                _config_update(launch["config"], record.run.config)
            elif kind == "config":
                _config_update(launch["config"], record.config)
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                launch["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "exit":
                launch["exit_code"] = record.exit.exit_code
            elif kind == "preempting":
                launch["preempting"] = True
        out.append(launch)
    return sorted(out, key=lambda launch: launch["start"])


def _config_update(config: dict, update) -> None:
    import json

    for item in update.update:
        key = item.key or "/".join(item.nested_key)
        if not key.startswith("_"):
            config[key] = json.loads(item.value_json)


def _wandb_records(path: str):
    """The protobuf records of one .wandb file: a 7-byte file header (":W&B", 0xBEE1, version
    0), then 32 KiB blocks of chunks, each `crc32 (4) | length (2) | type (1) | data`; a record
    is one FULL chunk or FIRST, MIDDLE..., LAST; a block's tail under 7 bytes is zeros."""
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2

    block = 32768
    with open(path, "rb") as fh:
        data = fh.read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (path, ident, magic, version)
    pos, parts = 7, []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros: the unwritten tail of a block or of a run still writing
            pos += room
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, (path, pos)
        pos += 7 + length
        parts.append(chunk)
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_series(launches: list[dict], tag: str) -> dict[int, float]:
    """{step: value} of one tag over the launches, a later launch's row replacing an earlier
    one of the same step (as `scalars` does for TensorBoard)."""
    return {row["step"]: row[tag] for launch in launches for row in launch["history"] if tag in row}


def free_port() -> int:
    """A free loopback port for a rendezvous, below the kernel's ephemeral range (32768 and up
    on Linux): a port the kernel hands out for some other test's outgoing connection (or a
    port-0 bind) cannot take it between this check and the launcher's bind. (If it was taken,
    torchrun would take the port's owner for the rendezvous host and wait on it.)"""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses ("127.0.0.1", "0.0.0.0", "::" ...) that these processes' TCP
    sockets listen on, from /proc (no `ss` needed)."""
    import ipaddress
    import struct

    inodes = set()
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/net/{table}") as fh:
            for row in list(fh)[1:]:
                cols = row.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(cols[1].split(":")[0])
                words = struct.unpack(f"<{width // 4}I", raw)  # stored as host-order words
                out.append(str(ipaddress.ip_address(struct.pack(f">{width // 4}I", *words))))
    return out


def children(pid: int) -> list[int]:
    """pid's child processes (none if it is gone)."""
    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as fh:
                found += [int(c) for c in fh.read().split()]
        except OSError:  # pid, or this thread of it, exited between the listing and the read
            pass
    return found


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (one that exits while it is read is left out of its parent's)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children(p)
    return tree
