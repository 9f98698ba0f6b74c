"""The suite's time budget: a pytest plugin that fails the run when one test, or the session, is
too slow for the machine it runs on.

Each test's time is its setup + call + teardown as the reports give them (a module-scoped
fixture's setup is charged to the first test that uses it, as pytest runs it there); under
pytest-xdist the workers' reports reach the controller, which sums them. The session's time is
the controller's wall time from session start to finish (collection and worker startup in it).

Budgets are in seconds on the reference machine (the 2-core AMD EPYC, AVX2, torch 2.13 CPU, where
the suite took ~1,800-2,000 s in November 2026) and scaled by a calibration measured at session
start: a fixed pure-Python workload (no torch: ~0.5 s) timed against its reference time, so a
machine half as fast gets twice the budget and fails on its own slowness no more than this one.

Settings (environment first, then pyproject's [tool.pytest.ini_options]):
    TRAINER_TEST_BUDGET=off          switch the guard off (local debugging; also off under --pdb)
    TRAINER_TEST_BUDGET_PER_TEST=S   / ini budget_per_test: reference seconds per test
    TRAINER_TEST_BUDGET_TOTAL=S      / ini budget_total: reference seconds for the session
    TRAINER_TEST_BUDGET_SCALE=X      use this machine scale instead of calibrating

Every run (the guard on or off) also ends with a per-file summary: seconds per test file, summed
over its tests' setup + call + teardown, the slowest in a short "slowest files" section and all
of them in `.pytest_cache/trainer-durations.json` (FileDurations): where each run's time went.
Beside each test's wall seconds the file keeps its CPU seconds (the test process's own and its
waited-for children's: the launches and their ranks): on two cores shared by two workers the
suite is CPU-bound, so CPU seconds, not wall seconds, say which test the suite waits on.

Loaded by tests/conftest.py (pytest_plugins), or `-p tests.budget` with the repository on the path.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

# Reference seconds when the ini file names none (pyproject.toml sets the suite's own).
DEFAULT_PER_TEST_S = 240.0
DEFAULT_TOTAL_S = 2400.0
# calibrate()'s time on the reference machine (best of 5: 0.084-0.097 s there; 0.11-0.15 s
# typical while other processes load its two cores, which then slow the tests as well), and the
# smallest scale granted: a machine with fast Python but slow matmuls must not fail by itself.
REFERENCE_CALIBRATION_S = 0.090
MIN_SCALE = 0.5
OFF = {"0", "off", "false", "no"}
# The per-file summary: where it is written (under the root directory), how many files the
# terminal section names.
DURATIONS_FILE = Path(".pytest_cache") / "trainer-durations.json"
SLOWEST_FILES = 10


def calibrate(repeats: int = 5) -> float:
    """Seconds of a fixed pure-Python workload (dict, string formatting, sort: the interpreter
    work that imports and launches are made of), the best of `repeats` so a moment of load
    from elsewhere does not count."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        table = {"k%d" % i: (i * 7919) % 1009 for i in range(40000)}
        rows = sorted(table.items(), key=lambda kv: (kv[1], kv[0]))
        sum(len(k) * v for k, v in rows if v & 1)
        best = min(best, time.perf_counter() - start)
    return best


def pytest_addoption(parser):
    parser.addini(
        "budget_per_test",
        "tests/budget.py: reference seconds one test may take",
        default=str(DEFAULT_PER_TEST_S),
    )
    parser.addini(
        "budget_total",
        "tests/budget.py: reference seconds the session may take",
        default=str(DEFAULT_TOTAL_S),
    )


def pytest_configure(config):
    """Register the guard on the process that sees every report: the controller under xdist
    (a worker's reports go to it), the only process otherwise."""
    if hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(FileDurations(config), "trainer-file-durations")
    if os.environ.get("TRAINER_TEST_BUDGET", "on").strip().lower() in OFF:
        return
    if config.getoption("usepdb", False) or config.getoption("trace", False):
        return  # a debugger's pauses are not the tests' time
    config.pluginmanager.register(Budget(config), "trainer-test-budget")


def launched_cpu() -> float:
    """CPU seconds of the launches that tests/helpers.py's zygote forked and saw end: their
    ledger (tests/scripts/zygote.py), named by TRAINER_TEST_CPU_LEDGER once the zygote runs.
    A fork of the zygote is not this process's child, so RUSAGE_CHILDREN would not see it."""
    path = os.environ.get("TRAINER_TEST_CPU_LEDGER")
    if not path:
        return 0.0
    try:
        with open(path) as fh:
            return sum(float(line) for line in fh if line.endswith("\n"))
    except FileNotFoundError:
        return 0.0


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, of its children that have been waited for (a
    launch's launcher and ranks, once it ends) and of the zygote's ended launches."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + launched_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Where each test's CPU time starts: makereport charges each phase the CPU since."""
    item._trainer_cpu_mark = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries its CPU seconds (user_properties travel from an xdist worker
    to the controller with the report)."""
    now = cpu_seconds()
    spent = now - getattr(item, "_trainer_cpu_mark", now)
    item._trainer_cpu_mark = now
    outcome = yield
    outcome.get_result().user_properties.append(("cpu_s", spent))


def _setting(config, env: str, ini: str) -> float:
    value = os.environ.get(env) or config.getini(ini)
    try:
        return float(value)
    except ValueError:
        raise pytest.UsageError(f"{env} / {ini}: expected seconds, got {value!r}") from None


class Budget:
    """Collects each test's seconds and the session's; over budget, sets the exit status to
    TESTS_FAILED and names the offenders in the terminal summary."""

    def __init__(self, config):
        self.per_test_ref = _setting(config, "TRAINER_TEST_BUDGET_PER_TEST", "budget_per_test")
        self.total_ref = _setting(config, "TRAINER_TEST_BUDGET_TOTAL", "budget_total")
        self.seconds: dict[str, float] = {}
        self.start = time.monotonic()
        self.scale = self.calibration = None
        self.over: list[str] = []
        self.elapsed = 0.0

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        self.start = time.monotonic()
        forced = os.environ.get("TRAINER_TEST_BUDGET_SCALE")
        if forced:
            self.scale = float(forced)
        else:
            self.calibration = calibrate()
            self.scale = max(MIN_SCALE, self.calibration / REFERENCE_CALIBRATION_S)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        """Before the terminal summary is written (the terminal reporter wraps this hook)."""
        self.elapsed = time.monotonic() - self.start
        per_test, total = self.per_test_ref * self.scale, self.total_ref * self.scale
        slow = sorted(((s, n) for n, s in self.seconds.items() if s > per_test), reverse=True)
        self.over = [f"{name} took {s:.1f} s > {per_test:.1f} s per test" for s, name in slow]
        if self.elapsed > total:
            self.over.append(f"the session took {self.elapsed:.1f} s > {total:.1f} s in total")
        if self.over and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        per_test, total = self.per_test_ref * self.scale, self.total_ref * self.scale
        how = (
            f"machine scale {self.scale:.2f}: calibration {self.calibration:.3f} s vs "
            f"{REFERENCE_CALIBRATION_S:.3f} s on the reference"
            if self.calibration is not None
            else f"machine scale {self.scale:.2f} from TRAINER_TEST_BUDGET_SCALE"
        )
        budgets = (
            f"budgets {self.per_test_ref:g} s per test and {self.total_ref:g} s in total on "
            f"the reference machine = {per_test:.1f} s and {total:.1f} s here ({how})"
        )
        write = terminalreporter.write_line
        if self.over:
            terminalreporter.write_sep("=", "test time budget exceeded", red=True, bold=True)
            for line in self.over:
                write(f"BUDGET EXCEEDED: {line}", red=True)
            write(f"{budgets}; tests/budget.py; TRAINER_TEST_BUDGET=off switches it off")
            return
        slowest = max(self.seconds.items(), key=lambda kv: kv[1], default=("(no test)", 0.0))
        write(
            f"test budget: slowest {slowest[0]} {slowest[1]:.1f} s, session {self.elapsed:.1f} s; "
            f"{budgets}"
        )


def per_file(seconds: dict[str, float]) -> dict[str, dict]:
    """{file: {"seconds", "tests"}} from {nodeid: seconds}, the slowest file first."""
    files: dict[str, dict] = {}
    for nodeid, s in seconds.items():
        entry = files.setdefault(nodeid.split("::", 1)[0], {"seconds": 0.0, "tests": 0})
        entry["seconds"] += s
        entry["tests"] += 1
    ranked = sorted(files.items(), key=lambda kv: (-kv[1]["seconds"], kv[0]))
    return {name: {"seconds": round(e["seconds"], 2), "tests": e["tests"]} for name, e in ranked}


def cpu_ticks() -> tuple[int, int, int] | None:
    """(steal, total, busy) clock ticks of every CPU since boot (/proc/stat), None where
    unreadable: a virtual machine's stolen time makes the same tests take more CPU seconds;
    busy (user, nice, system, irq, softirq) is every process's work, booked or not."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6) if i < len(fields))
    return (fields[7] if len(fields) > 7 else 0), sum(fields), busy


class FileDurations:
    """Seconds per test file (setup + call + teardown of its tests, summed over the xdist
    workers' reports on the controller): written to DURATIONS_FILE at session finish, its
    slowest SLOWEST_FILES named in a "slowest files" terminal section. Beside them, what the
    machine was like: calibrate()'s seconds at the start and the end, and the share of CPU
    time the hypervisor stole, so two runs' figures can be compared honestly."""

    def __init__(self, config):
        self.path = Path(str(config.rootpath)) / DURATIONS_FILE
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.files: dict[str, dict] = {}
        self.start = time.monotonic()
        self.machine: dict = {}
        self._ticks = cpu_ticks()

    def pytest_sessionstart(self, session):
        self.machine["calibration_start_s"] = round(calibrate(), 4)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        cpu = sum(v for k, v in report.user_properties if k == "cpu_s")
        self.cpu[report.nodeid] = self.cpu.get(report.nodeid, 0.0) + cpu

    def pytest_sessionfinish(self, session, exitstatus):
        self.files = per_file(self.seconds)
        if not self.files:
            return
        self.machine["calibration_end_s"] = round(calibrate(), 4)
        ticks = cpu_ticks()
        if ticks and self._ticks and ticks[1] > self._ticks[1]:
            self.machine["steal_fraction"] = round(
                (ticks[0] - self._ticks[0]) / (ticks[1] - self._ticks[1]), 4
            )
            # the machine's busy share: what the booked CPU-s miss (collection, the zygotes,
            # SLURM's jobs, a launch killed unwaited) is the difference
            self.machine["busy_fraction"] = round(
                (ticks[2] - self._ticks[2]) / (ticks[1] - self._ticks[1]), 4
            )
            self.machine["busy_cpu_s"] = round(
                (ticks[2] - self._ticks[2]) / os.sysconf("SC_CLK_TCK"), 1
            )
        cpu_files = per_file(self.cpu)
        for name, entry in self.files.items():
            entry["cpu_s"] = cpu_files.get(name, {}).get("seconds", 0.0)
        summary = {
            "wall_s": round(time.monotonic() - self.start, 2),
            "tests_s": round(sum(self.seconds.values()), 2),
            "cpu_s": round(sum(self.cpu.values()), 2),
            "machine": self.machine,
            "files": self.files,
            "tests": {
                n: round(s, 2) for n, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])
            },
            "tests_cpu_s": {
                n: round(s, 2) for n, s in sorted(self.cpu.items(), key=lambda kv: -kv[1])
            },
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(summary, indent=1) + "\n")
        except OSError:  # a read-only checkout still gets the terminal section
            pass

    def pytest_terminal_summary(self, terminalreporter):
        if not self.files:
            return
        m = self.machine
        terminalreporter.write_sep(
            "-", f"slowest files (setup + call + teardown; all in {DURATIONS_FILE})"
        )
        terminalreporter.write_line(
            f"machine: calibration {m.get('calibration_start_s', 0):.3f} s at the start, "
            f"{m.get('calibration_end_s', 0):.3f} s at the end; CPU stolen "
            f"{100 * m.get('steal_fraction', 0):.1f}%; busy {100 * m.get('busy_fraction', 0):.0f}%"
            f" ({m.get('busy_cpu_s', 0):,.0f} CPU-s, the tests booked "
            f"{sum(e['cpu_s'] for e in self.files.values()):,.0f})"
        )
        for name, entry in list(self.files.items())[:SLOWEST_FILES]:
            terminalreporter.write_line(
                f"{entry['seconds']:8.1f} s  {entry['cpu_s']:8.1f} CPU-s  {entry['tests']:3d} tests"
                f"  {name}"
            )
