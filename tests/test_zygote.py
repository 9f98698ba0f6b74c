"""The launcher zygote (tests/scripts/zygote.py, tests/helpers.py's zygote_env): a run_train
launch forked from it says what a fresh interpreter's says, exits with its status, gets the
environment run_train gave it, and dies whole when the test's timeout kills run_train.sh."""

import subprocess
import time

import pytest

from tests import helpers
from tests.helpers import TINY, process_tree, run_train


def test_a_refused_launch_is_the_same_one_line(monkeypatch, tmp_path):
    bad = ("--training.steps", "-1")
    monkeypatch.setenv("TRAINER_TEST_ZYGOTE", "0")
    fresh = run_train(tmp_path / "a", *TINY, *bad, check=False)
    monkeypatch.setenv("TRAINER_TEST_ZYGOTE", "on")
    assert helpers.zygote_env(None)  # this launch goes through the zygote
    forked = run_train(tmp_path / "b", *TINY, *bad, check=False)
    assert fresh.returncode == forked.returncode == 2, (fresh.stderr, forked.stderr)
    assert fresh.stderr.strip() and fresh.stderr == forked.stderr, (fresh.stderr, forked.stderr)
    assert fresh.stdout == forked.stdout


def test_a_launch_trains_with_the_environment_it_was_given(monkeypatch, tmp_path):
    """... and books its CPU seconds (launcher and ranks) in the ledger that tests/budget.py
    charges to the test: the zygote's forks are not the pytest worker's children."""
    from tests.budget import launched_cpu

    monkeypatch.setenv("TRAINER_TEST_ZYGOTE", "on")
    helpers.zygote_env(None)
    before = launched_cpu()
    proc = run_train(
        tmp_path / "run",
        *TINY,
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "false",
        env={"TRAINER_DEBUG_DATA_HASHES": "1"},
        log_rank="0,1",
    )
    assert "training done at step 1" in proc.stdout, proc.stdout
    assert len(helpers.global_batches(proc.stdout)) == 1  # both ranks saw the variable
    assert "zygote" not in proc.stdout + proc.stderr
    # two forked ranks (nothing to import) set up and take a step: ~1.2 CPU-s here
    assert launched_cpu() - before > 0.3, (before, launched_cpu())


def test_a_timeout_kills_the_launch_and_its_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINER_TEST_ZYGOTE", "on")
    helpers.zygote_env(None)
    server = helpers._zygote["server"]
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        # no step lines: a launch left running would not die of a write to the closed pipe
        # and its ranks sleep between steps (TRAINER_TEST_SLOW_RANK): the timeout finds them
        # running, not burning the cores the other worker's tests share
        run_train(
            tmp_path / "slow",
            *TINY,
            "--training.steps",
            "100000",
            "--metrics.log_freq",
            "1000000",
            "--checkpoint.enable",
            "false",
            timeout=6,
            env={"TRAINER_TEST_SLOW_RANK": "all:2"},
        )
    # before it was killed, each process of the launch printed its threads' stacks (SIGABRT,
    # faulthandler): where a hung launch hung, in the test's failure
    message = str(timed_out.value)
    assert "processes of the launch sent SIGABRT" in message, message
    # (a name or a path is one write of faulthandler's: whole even where two dumps interleave)
    assert "forked_rank" in message and "trainer/launch.py" in message, message
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and len(process_tree(server)) > 1:
        time.sleep(0.2)
    assert process_tree(server) == [server]  # no launch, rank or handler left


def test_a_forked_script_and_module_run_as_the_interpreter_runs_them(tmp_path):
    """fork_python: a script gets its argv and its folder as sys.path[0]; its exit handlers run
    and sys.exit("message") prints the message and exits 1; `-m` runs a module's __main__."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import atexit, sys\natexit.register(lambda: print('exit handler'))\n"
        "print(sys.argv[1:], sys.path[0])\nsys.exit('stopped here')\n"
    )
    python, env = helpers.fork_python()
    assert python == helpers._zygote["wrapper"]  # forked, not a fresh interpreter
    proc = subprocess.run(
        [python, str(script), "a"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stderr.strip() == "stopped here", proc.stderr
    assert proc.stdout.splitlines() == [f"['a'] {tmp_path}", "exit handler"], proc.stdout
    proc = subprocess.run(
        [python, "-m", "trainer.config", "--help"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "[checkpoint]" in proc.stdout, proc.stderr
