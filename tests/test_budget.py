"""The time budget's guard (tests/budget.py): a planted slow test fails the run, with the offender
and the budget named; a run under budget, or with the guard switched off, passes.

Each case is a pytest session in a subprocess on a tiny planted file, with tiny budgets and the
machine scale fixed by environment variables; the sessions load only xdist and the guard (no
torch) and run at once, so the file takes a few seconds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.budget import DURATIONS_FILE, per_file
from tests.helpers import REPO, subprocess_env

PLANTED = """
import subprocess
import sys
import time

def test_quick():
    pass

def test_slow():  # a child process's CPU seconds (~0.1-0.3 s) are the test's; its sleep is not CPU
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    time.sleep({sleep})
"""

# name: (sleep of test_slow, budget environment, pytest arguments)
CASES = {
    # per test 0.5 s on the reference at scale 2 = 1 s; the slow test sleeps 1.5 s; under xdist,
    # so its time comes from the worker's reports.
    "per_test": (
        1.5,
        {"TRAINER_TEST_BUDGET_PER_TEST": "0.5", "TRAINER_TEST_BUDGET_SCALE": "2"},
        ["-n", "1"],
    ),
    # the session over 0.2 s x 1 while no test is over its 30 s
    "total": (
        0.5,
        {
            "TRAINER_TEST_BUDGET_PER_TEST": "30",
            "TRAINER_TEST_BUDGET_TOTAL": "0.2",
            "TRAINER_TEST_BUDGET_SCALE": "1",
        },
        ["-n", "0"],
    ),
    # under budget on this machine's own calibration (no scale given)
    "under": (
        0.1,
        {
            "TRAINER_TEST_BUDGET_PER_TEST": "30",
            "TRAINER_TEST_BUDGET_TOTAL": "60",
            "TRAINER_TEST_BUDGET_SCALE": None,
        },
        ["-n", "0"],
    ),
    # the per_test case with the guard switched off
    "off": (
        1.5,
        {
            "TRAINER_TEST_BUDGET": "off",
            "TRAINER_TEST_BUDGET_PER_TEST": "0.5",
            "TRAINER_TEST_BUDGET_SCALE": "2",
        },
        ["-n", "0"],
    ),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every case's pytest session, run concurrently: {name: completed process, with the
    planted file's `folder`}."""
    procs = {}
    for name, (sleep, env, args) in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        (folder / "test_planted.py").write_text(PLANTED.format(sleep=sleep))
        (folder / "pytest.ini").write_text("[pytest]\n")  # not the repository's addopts
        # only xdist and the guard: hypothesis's plugin alone imports for ~1 s
        base = {
            "TRAINER_TEST_BUDGET": "on",
            "TRAINER_TEST_BUDGET_TOTAL": None,
            "TRAINER_TEST_CPU_LEDGER": None,  # not this worker's launches
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        }
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "xdist.plugin",
            "-p",
            "tests.budget",
            "-p",
            "no:cacheprovider",
            "-c",
            str(folder / "pytest.ini"),
            "--rootdir",
            str(folder),
            *args,
            str(folder / "test_planted.py"),
        ]
        procs[name] = subprocess.Popen(
            cmd,
            cwd=folder,
            env=subprocess_env({**base, **env}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs[name].folder = folder
    out = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")
        out[name].folder = proc.folder
    assert str(REPO) in subprocess_env()["PYTHONPATH"]  # how `-p tests.budget` is found
    return out


def test_slow_test_fails_the_run(sessions):
    run = sessions["per_test"]
    assert run.returncode == 1, run.stdout
    assert "2 passed" in run.stdout, run.stdout  # the tests passed; the budget failed the run
    assert "test time budget exceeded" in run.stdout, run.stdout
    offenders = [line for line in run.stdout.splitlines() if line.startswith("BUDGET EXCEEDED")]
    assert len(offenders) == 1, run.stdout  # test_quick is not named
    assert "test_planted.py::test_slow took" in offenders[0], run.stdout
    assert "> 1.0 s per test" in offenders[0], run.stdout
    assert "budgets 0.5 s per test" in run.stdout and "machine scale 2.00" in run.stdout, run.stdout
    assert "TRAINER_TEST_BUDGET=off" in run.stdout, run.stdout


def test_slow_session_fails_the_run(sessions):
    run = sessions["total"]
    assert run.returncode == 1, run.stdout
    offenders = [line for line in run.stdout.splitlines() if line.startswith("BUDGET EXCEEDED")]
    assert len(offenders) == 1, run.stdout  # no test is over its own budget
    assert offenders[0].startswith("BUDGET EXCEEDED: the session took"), run.stdout
    assert offenders[0].endswith("> 0.2 s in total"), run.stdout


def test_under_budget_passes_and_says_its_budgets(sessions):
    run = sessions["under"]
    assert run.returncode == 0, run.stdout
    assert "test budget: slowest" in run.stdout and "test_planted.py::test_slow" in run.stdout
    assert "calibration" in run.stdout and "BUDGET EXCEEDED" not in run.stdout, run.stdout


def test_switched_off(sessions):
    run = sessions["off"]
    assert run.returncode == 0, run.stdout
    assert "budget" not in run.stdout, run.stdout


def test_per_file_sums_a_files_tests_slowest_first():
    seconds = {
        "tests/test_a.py::test_x": 1.0,
        "tests/test_a.py::test_y[p]": 2.5,
        "tests/test_b.py::test_z": 3.0,
        "tests/sub/test_c.py::T::test_w": 0.25,
    }
    files = per_file(seconds)
    assert list(files) == ["tests/test_a.py", "tests/test_b.py", "tests/sub/test_c.py"]
    assert files["tests/test_a.py"] == {"seconds": 3.5, "tests": 2}
    assert files["tests/sub/test_c.py"] == {"seconds": 0.25, "tests": 1}


@pytest.mark.parametrize("case", ["per_test", "off"])
def test_every_run_writes_its_seconds_per_file(sessions, case):
    """Under xdist (per_test) the workers' reports are summed on the controller; the summary is
    written with the guard switched off as well (off)."""
    run = sessions[case]
    summary = json.loads((run.folder / DURATIONS_FILE).read_text())
    assert list(summary["files"]) == ["test_planted.py"], summary
    entry = summary["files"]["test_planted.py"]
    assert entry["tests"] == 2 and 1.5 <= entry["seconds"] < 1.5 + 5, summary
    assert summary["tests"]["test_planted.py::test_slow"] >= 1.5, summary
    assert list(summary["tests"])[0] == "test_planted.py::test_slow", summary  # slowest first
    assert summary["wall_s"] >= entry["seconds"] - 0.5, summary
    # CPU seconds: the child's burn is test_slow's, its sleep (1.5 s) is not; test_quick's ~0.
    cpu = summary["tests_cpu_s"]
    assert 0.05 <= cpu["test_planted.py::test_slow"] < 1.0, summary
    assert cpu["test_planted.py::test_quick"] < 0.05, summary
    assert entry["cpu_s"] == pytest.approx(sum(cpu.values()), abs=0.02), summary
    assert 0 < summary["machine"]["calibration_start_s"] < 10, summary
    assert 0 < summary["machine"]["calibration_end_s"] < 10, summary
    assert 0 <= summary["machine"].get("steal_fraction", 0) < 1, summary
    assert 0 < summary["machine"]["busy_fraction"] <= 1 and summary["machine"]["busy_cpu_s"] > 0
    section = run.stdout.split("slowest files", 1)[1].splitlines()
    assert section[1].startswith("machine: calibration ") and "CPU stolen" in section[1]
    assert "test_planted.py" in section[2] and " 2 tests " in section[2], run.stdout
    assert " CPU-s " in section[2], run.stdout
