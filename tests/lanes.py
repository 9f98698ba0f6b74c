"""A waiting lane for pytest-xdist: the test files that spend most of their time waiting (on
SLURM's scheduler, a store's timeouts, a straggler's sleeps, a lease's expiry) run on an extra
worker of their own, beside one worker per core that takes every other file.

Under `-n auto --dist loadfile` (pyproject's addopts) the suite is bound by the CPU, so a third
worker taking any file only adds contention (session 28: 776 s with 2 workers, 845 s with 3 on
the 2-core Xeon). These files are the exception: in a whole suite the four of them took ~300 s
of a worker's time for ~95 CPU-s, time in which the other core-worker ran alone. On their own
lane the core-workers never wait behind them.

`-n auto` starts one worker more than it would (when the run includes a waiting file); the
last worker (gw<N-1>) takes only the waiting files, in order, and stops when they are done; the
others take the rest, longest first (tests/conftest.py), and the waiting files too if the lane
is gone. With fewer than three workers it is plain `--dist loadfile`. TRAINER_TEST_LANES=off
switches it off.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Measured in a whole clean-clone suite on the 2-core Xeon (session 28, wall / CPU-s of the
# file's tests; a SLURM job's ranks are the daemons' children, not counted): test_slurm 82 / 1,
# test_object_store_faults 122 / 66, test_heal 55 / 15, test_lease 42 / 12.
WAITING = ("test_slurm.py", "test_object_store_faults.py", "test_heal.py", "test_lease.py")


def enabled() -> bool:
    return os.environ.get("TRAINER_TEST_LANES", "on") != "off"


def is_waiting(path: str) -> bool:
    return path.split("::", 1)[0].rsplit("/", 1)[-1] in WAITING


def _selects_a_waiting_file(config) -> bool:
    """Whether the run's arguments can collect a waiting file (a folder, or one of them)."""
    for arg in config.args or ["."]:
        path = Path(config.invocation_params.dir, arg.split("::", 1)[0])
        if path.is_dir() or is_waiting(str(path)):
            return True
    return False


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, and one for the waiting lane when it has work."""
    if enabled() and config.getvalue("dist") == "loadfile" and _selects_a_waiting_file(config):
        return _cores() + 1
    return None  # xdist's own count


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if enabled() and config.getvalue("dist") == "loadfile":
        return _lane_scheduling()(config, log)
    return None


def _lane_scheduling():
    from xdist.scheduler import LoadFileScheduling

    class LaneScheduling(LoadFileScheduling):
        """--dist loadfile, the last of three or more workers taking only the waiting files."""

        lane = None  # the lane's worker, chosen once all have collected

        def schedule(self) -> None:
            if self.collection is None and len(self.nodes) >= 3:
                self.lane = max(self.nodes, key=lambda n: int(n.gateway.id.removeprefix("gw")))
            super().schedule()

        def _next_scope(self, node) -> str | None:
            lane = self.lane
            mine = [s for s in self.workqueue if lane is None or is_waiting(s) == (node is lane)]
            if mine:
                return mine[0]
            if node is not lane and (lane not in self.assigned_work or lane.shutting_down):
                return next(iter(self.workqueue), None)  # the lane is gone: take its files
            return None

        def _assign_work_unit(self, node) -> None:
            scope = self._next_scope(node)
            if scope is None:
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in
                                    work_unit.items() if not done])

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if self._next_scope(node) is None:
                node.shutdown()  # finishes what it holds, then stops
                return
            if self._pending_of(self.assigned_work[node]) > 2:
                return
            self._assign_work_unit(node)

    return LaneScheduling
