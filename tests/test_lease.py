"""One run per dump folder (trainer/checkpoint/lease.py): the lease's rules in-process, then two
real runs into one folder, a lease left by a SIGKILLed run, and a refused resume that leaves
every file as it was."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import (
    BASE_FP32,
    REPO,
    RUN_TRAIN,
    fork_python,
    listening_addresses,
    losses,
    process_tree,
    run_train,
    subprocess_env,
)
from trainer.checkpoint import lease as lease_mod
from trainer.checkpoint.lease import LEASE_FILE, Holder, Lease, LeaseHeld, check_free


@pytest.fixture(autouse=True)
def _own_job(monkeypatch):
    """This process is a job of its own (`pid N`), not the torchrun job running the tests."""
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def plant(folder: Path, **fields) -> Holder:
    now = time.time()
    holder = Holder(
        **{
            "host": "node-7",
            "job": "slurm 4242",
            "pid": 12345,
            "start": "1",
            "since": now - 100,
            "heartbeat": now,
            "token": "t" * 32,
            **fields,
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LEASE_FILE).write_text(json.dumps(holder.__dict__))
    return holder


def test_take_refresh_release(tmp_path):
    lease = Lease(str(tmp_path / "run"), 60)
    lease.acquire()
    held = json.loads((tmp_path / "run" / LEASE_FILE).read_text())
    assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
    assert held["job"] == f"pid {os.getpid()}"
    before = held["heartbeat"]
    time.sleep(0.01)
    lease.refresh()
    assert json.loads((tmp_path / "run" / LEASE_FILE).read_text())["heartbeat"] > before
    assert os.listdir(tmp_path / "run") == [LEASE_FILE]  # no temporary file left behind
    lease.release()
    assert os.listdir(tmp_path / "run") == []


def test_a_live_holder_is_named_and_nothing_is_touched(tmp_path):
    plant(tmp_path)
    before = (tmp_path / LEASE_FILE).read_bytes()
    with pytest.raises(LeaseHeld) as e:
        Lease(str(tmp_path), 60).acquire()
    assert str(e.value).startswith(
        f"job.dump_folder {tmp_path} is in use by another run: slurm "
        "4242 on node-7 (pid 12345), heartbeat 0s ago"
    )
    with pytest.raises(LeaseHeld):
        check_free(str(tmp_path), 60, env={})
    assert (tmp_path / LEASE_FILE).read_bytes() == before
    assert os.listdir(tmp_path) == [LEASE_FILE]


@pytest.mark.parametrize("case", ["heartbeat stopped", "process gone", "same job"])
def test_takeover(tmp_path, monkeypatch, case):
    if case == "heartbeat stopped":
        plant(tmp_path, heartbeat=time.time() - 61)
        expected = "(no heartbeat for 61s > job.lease_timeout_seconds = 60)"
    elif case == "process gone":
        dead = subprocess.Popen(["true"])
        dead.wait()
        plant(tmp_path, host=socket.gethostname(), job="torchrun local-1", pid=dead.pid)
        expected = f"(its process {dead.pid} on this host is gone)"
    else:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a requeue, on another node
        plant(tmp_path)
        expected = None
    check_free(str(tmp_path), 60, env=dict(os.environ))
    said = []
    lease = Lease(str(tmp_path), 60, log=said.append)
    lease.acquire()
    assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == lease.me.token
    if expected is None:
        assert said == []
    else:
        (line,) = said
        assert line.startswith(
            f"dump folder {tmp_path}: taking over the lease of "
        ) and line.endswith(expected), line
    assert sorted(os.listdir(tmp_path)) == [LEASE_FILE]


def test_a_holder_on_another_machine_with_this_host_name_is_not_probed_here(tmp_path):
    """Two machines (or containers) can share a host name; a pid that is gone here says
    nothing of a process there: its lease stays held while its heartbeat is fresh."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    plant(tmp_path, host=socket.gethostname(), pid=dead.pid, machine="another-boot pid:[1]")
    with pytest.raises(LeaseHeld, match="in use by another run"):
        Lease(str(tmp_path), 60).acquire()
    plant(tmp_path, host=socket.gethostname(), pid=dead.pid, machine=lease_mod.machine_id())
    Lease(str(tmp_path), 60).acquire()  # this machine's record: the pid is probed, and free


def test_a_holder_that_lost_its_lease_says_so(tmp_path):
    said = []
    lease = Lease(str(tmp_path), 60, log=said.append)
    lease.acquire()
    plant(tmp_path)  # another run took it (e.g. this one was frozen past the timeout)
    lease.refresh()
    assert lease.lost and said[0].startswith(
        f"warning: this run lost the lease on {tmp_path} (now held by slurm 4242 on node-7"
    )
    lease.release()
    assert (tmp_path / LEASE_FILE).exists()  # not ours: left alone


def test_a_claim_left_by_a_dead_contender_is_dropped(tmp_path):
    stale = plant(tmp_path, heartbeat=time.time() - 600)
    claim = tmp_path / f"{LEASE_FILE}.{stale.token}.takeover"
    claim.touch()
    os.utime(claim, (time.time() - 61, time.time() - 61))
    lease = Lease(str(tmp_path), 60, log=lambda line: None)
    lease.acquire()
    assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == lease.me.token
    assert os.listdir(tmp_path) == [LEASE_FILE]


def _contend(folder: str, start: float, results, done) -> None:
    time.sleep(max(0.0, start - time.time()))
    try:
        Lease(folder, 60, log=lambda line: None).acquire()
        results.put(os.getpid())
    except LeaseHeld:
        results.put(None)
    done.wait(60)  # a winner that exited would leave a lease whose process is gone: free


def test_one_winner_among_racing_takers(tmp_path):
    """Eight processes take over one stale lease at the same moment: exactly one holds it."""
    plant(tmp_path, heartbeat=time.time() - 600)
    ctx = multiprocessing.get_context("fork")
    results, done = ctx.Queue(), ctx.Event()
    start = time.time() + 0.5
    procs = [
        ctx.Process(target=_contend, args=(str(tmp_path), start, results, done)) for _ in range(8)
    ]
    for p in procs:
        p.start()
    outcome = [results.get(timeout=60) for _ in procs]
    done.set()
    for p in procs:
        p.join()
    winners = [pid for pid in outcome if pid is not None]
    assert len(winners) == 1, outcome
    assert json.loads((tmp_path / LEASE_FILE).read_text())["pid"] == winners[0]
    assert os.listdir(tmp_path) == [LEASE_FILE]


# --------------------------------------------------------------------------- real runs

RUN = [
    *BASE_FP32,
    "--training.steps",
    "6",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
]
# rank 0 sleeps after each step while a gate file exists (at most 6 s a step): a run to
# collide with, still running while a loaded machine starts the refused ones, and done soon
# after the test removes the gate


def slow(gate: Path) -> dict:
    gate.touch()
    return {"TRAINER_TEST_SLOW_RANK": f"0:6:{gate}"}


def start(dump: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    extra = {"NGPU": "2", "LOG_RANK": "0", **(env or {})}
    return subprocess.Popen(
        [str(RUN_TRAIN), "--job.dump_folder", str(dump), *overrides],
        env=subprocess_env(extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_lease(dump: Path, proc: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return json.loads((dump / LEASE_FILE).read_text())
        except (OSError, ValueError):
            time.sleep(0.2)
    raise AssertionError(f"no lease from the run: {proc.communicate()}")


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_two_runs_one_folder_a_killed_holder_and_a_refused_resume(tmp_path):
    first, folder = None, tmp_path / "shared"
    try:
        first = start(folder, *RUN, env=slow(tmp_path / "first.gate"))
        held = wait_for_lease(folder, first)
        # A single-node run listens on loopback only: torchrun's two stores, gloo.
        addresses = listening_addresses(process_tree(first.pid))
        assert addresses and set(addresses) == {"127.0.0.1"}, addresses
        # A second run into the held folder: refused by run_train.sh's check, in seconds...
        t0 = time.monotonic()
        second = run_train(folder, *RUN, check=False, timeout=120)
        took = time.monotonic() - t0
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(
            f"config error: job.dump_folder {folder} is in use by another "
            f"run: {held['job']} on {held['host']} (pid {held['pid']})"
        )
        assert took < 30, took
        # ...and by the trainer itself when started without it (plain torchrun or python).
        python, env = fork_python()  # `python -m trainer.train`, forked from the zygote
        direct = subprocess.run(
            [python, "-m", "trainer.train", "--job.dump_folder", str(folder), *RUN],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert direct.returncode == 2 and direct.stderr.strip().startswith(
            f"config error: job.dump_folder {folder} is in use by another run: {held['job']}"
        )

        # A lease left by a SIGKILLed run is taken over by the next one at once.
        killed_folder = tmp_path / "killed"
        killed = start(
            killed_folder, *RUN, "--checkpoint.enable", "false", env=slow(tmp_path / "killed.gate")
        )
        dead = wait_for_lease(killed_folder, killed)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        assert (killed_folder / LEASE_FILE).exists()
        lone = run_train(killed_folder, *RUN, timeout=300)
        assert (
            f"dump folder {killed_folder}: taking over the lease of {dead['job']} on "
            f"{dead['host']} (pid {dead['pid']})" in lone.stdout
        )
        assert not (killed_folder / LEASE_FILE).exists()  # released at the end

        (tmp_path / "first.gate").unlink()  # the checks are done: let it finish
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first is not None and first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    # The first run is untouched: every checkpoint committed, losses equal to a lone run's.
    ckpts = sorted(p.name for p in (folder / "checkpoint").iterdir())
    assert ckpts == ["step-2", "step-4", "step-6"], ckpts
    assert all((folder / "checkpoint" / c / "manifest.json").is_file() for c in ckpts)
    assert losses(folder) == losses(killed_folder) and len(losses(folder)) == 6
    assert not (folder / LEASE_FILE).exists()

    # A resume refused (another seed) leaves every file of the folder byte-identical.
    before = snapshot(folder)
    refused = run_train(
        folder, *RUN, "--training.steps", "8", "--job.seed", "1", check=False, timeout=120
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "seed" in refused.stderr
    assert snapshot(folder) == before


def test_a_run_whose_folder_another_run_took_stops_without_saving(tmp_path):
    """A run frozen past the timeout, whose folder another run then took (its lease replaced):
    at the next step end every rank stops, exit 2, with rank 0's one line naming the folder
    and the new holder; nothing more is saved there (its retention would delete the other
    run's checkpoints: it went on training and saving) and the lease stays the other run's."""
    folder, gate = tmp_path / "run", tmp_path / "gate"
    gate.touch()  # rank 0 sleeps 2 s after each step: the lease's beat (every 0.83 s) sees it
    proc = start(
        folder,
        *RUN,
        "--job.lease_timeout_seconds",
        "5",
        env={"TRAINER_TEST_SLOW_RANK": f"0:2:{gate}"},
    )
    try:
        wait_for_lease(folder, proc)
        deadline = time.monotonic() + 120
        while not (folder / "checkpoint" / "step-2").is_dir():  # committed (renamed in place)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        thief = plant(folder)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err[-3000:]
    assert lines[-1].startswith(
        f"checkpoint error: this run lost the lease on {folder} (now "
        f"held by {thief.job} on {thief.host} (pid {thief.pid})"
    ), err
    assert lines[-1].endswith("stopping without saving, the folder is the other run's now")
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["step-2"]
    assert json.loads((folder / LEASE_FILE).read_text())["token"] == thief.token
