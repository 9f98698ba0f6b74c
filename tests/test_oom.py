"""A CUDA out-of-memory in a step ends the run with one line and exit code 5, on every rank
count that hits it, without the other rank hanging. CPU ranks raise torch.OutOfMemoryError
through the TRAINER_TEST_OOM hook (trainer/health/oom.py) after a step's forward."""

import re
import time

import pytest

from tests.helpers import STDLIB_VOCAB, TINY, run_train, zygote_env


@pytest.mark.parametrize("ranks", ["1", "0,1"])  # a peer waits in a collective / both fail
def test_out_of_memory_is_one_line(tmp_path, ranks):
    zygote_env(None)  # the launch zygote (a worker's first use starts it) outside the timing
    start = time.monotonic()
    # The debug shape (and vocab): the plan fits it on a 1.6 GiB device only below the batch
    # it runs.
    proc = run_train(
        tmp_path,
        *TINY,
        "--model.flavor",
        "debugmodel",
        *STDLIB_VOCAB,
        "--training.steps",
        "4",
        check=False,
        env={"TRAINER_TEST_OOM": f"{ranks}:2:1.6"},
        timeout=120,
    )
    assert proc.returncode == 5, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(
        r"training error: CUDA out of memory at step 2 on rank [01] \(.*\); the "
        r"memory plan fits local_batch_size <= \d+ here \(now 2\); see "
        r"python -m trainer\.plan --config (\S+) --ngpu 2 .*--gpu-mem-gib 1\.6",
        lines[0],
    )
    # The command plans the run's own model: its effective config, CLI overrides included.
    assert re.search(r"--config (\S+)", lines[0]).group(1) == str(tmp_path / "config.toml")
    assert "step:     1" in proc.stdout and "step:     2" not in proc.stdout
    assert time.monotonic() - start < 60  # no rank waited for a collective timeout
