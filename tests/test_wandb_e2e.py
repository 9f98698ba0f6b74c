"""W&B end to end: offline runs through run_train.sh on 2 CPU ranks with checkpoints, judged
by the run files in the dump folder.

Launch 1 trains steps 1-4 (checkpoints at 2 and 4). Launch 2 resumes from the checkpoint of
step 2 (`checkpoint.load_step`, a rollback) and trains to step 6: it must continue the same W&B
run and keep the replayed steps 3 and 4, which W&B's own step would refuse.
"""

from __future__ import annotations

import glob
import os

import pytest

from tests.helpers import (
    BASE_FP32,
    TINY,
    run_train,
    scalars,
    wandb_launches,
    wandb_offline_env,
    wandb_or_skip,
    wandb_series,
)
from trainer.observe.wandb_logger import RUN_ID_FILE

COMMON = [
    *BASE_FP32,
    "--metrics.enable_wandb",
    "true",
    "--metrics.peak_tflops",
    "0.5",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
]
LOSS, MFU, RSS = "loss_metrics/global_avg_loss", "mfu(%)", "memory/max_rss(GiB)"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    wandb_or_skip()
    dump = tmp_path_factory.mktemp("wandb_e2e")
    env = wandb_offline_env(tmp_path_factory.mktemp("wandb_home"))
    first = run_train(dump, *COMMON, "--training.steps", "4", env=env)
    second = run_train(
        dump, *COMMON, "--training.steps", "6", "--checkpoint.load_step", "2", env=env
    )
    return dump, first.stdout, second.stdout


def test_rank0_writes_the_scalars_and_config_into_the_dump_folder(runs):
    dump, first, _ = runs
    rid = (dump / RUN_ID_FILE).read_text().strip()
    assert (
        f"wandb: offline run '{dump.name}', id {rid} (first in this dump folder), project "
        f"trainer; local files {dump}/wandb/offline-run-" in first
    )
    launch = wandb_launches(dump / "wandb")[0]  # one per launch: rank 1 opened none
    assert launch["id"] == rid and launch["exit_code"] == 0
    for tag in (LOSS, MFU, RSS):
        assert sorted(wandb_series([launch], tag)) == [1, 2, 3, 4], tag
    assert launch["config"]["metrics"]["peak_tflops"] == 0.5
    assert launch["config"]["training"]["steps"] == 4
    assert launch["config"]["model"]["flavor"] == "debugmodel-tiny"
    assert launch["config"]["derived"]["parallel"].startswith("FSDP")


def test_a_resume_continues_the_run_and_keeps_replayed_steps(runs):
    dump, _, second = runs
    first_launch, second_launch = wandb_launches(dump / "wandb")
    assert first_launch["id"] == second_launch["id"]
    assert "(continues this dump folder's run)" in second
    assert sorted(wandb_series([second_launch], LOSS)) == [3, 4, 5, 6]
    assert second_launch["config"]["training"]["steps"] == 6  # this launch's config
    # The replay of steps 3 and 4 (an exact resume) logged what the first launch did.
    for step in (3, 4):
        assert wandb_series([second_launch], LOSS)[step] == pytest.approx(
            wandb_series([first_launch], LOSS)[step], rel=1e-6
        )


def test_same_scalars_as_tensorboard(runs):
    """Every tag TensorBoard got, at the same steps with the same values (a later launch
    replacing a step in both)."""
    dump, _, _ = runs
    launches = wandb_launches(dump / "wandb")
    tags = {tag for launch in launches for row in launch["history"] for tag in row} - {"step"}
    assert tags == tensorboard_tags(dump)
    assert {LOSS, MFU, RSS, "lr", "grad_norm", "batch_metrics/global_batch_size"} <= tags
    for tag in tags:
        tb = scalars(dump, tag)
        assert sorted(tb) == [1, 2, 3, 4, 5, 6], tag
        assert wandb_series(launches, tag) == pytest.approx(tb, rel=1e-6), tag


def tensorboard_tags(dump) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for run in glob.glob(os.path.join(dump, "tb", "*")):
        acc = EventAccumulator(run)
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def test_missing_package_is_one_line_before_any_process_starts(tmp_path):
    """wandb hidden from the config check by a sitecustomize shim on PYTHONPATH."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    dump = tmp_path / "dump"
    proc = run_train(
        dump, "--metrics.enable_wandb", "true", check=False, env={"PYTHONPATH": str(shim)}
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "config error: metrics.enable_wandb = true needs the wandb package, which is not "
        'installed: pip install -e ".[wandb]" (or pip install wandb)'
    ]
    assert not dump.exists()  # no rank ever started


def test_a_run_wandb_refuses_stops_every_rank_with_one_line(tmp_path):
    """wandb.init fails on rank 0 alone (a WANDB_MODE it does not know): rank 1, waiting for
    it, stops too, at once, with the same user error (not at the 300 s setup timeout)."""
    wandb_or_skip()
    env = {**wandb_offline_env(tmp_path), "WANDB_MODE": "bogus"}
    proc = run_train(
        tmp_path / "dump",
        *TINY,
        "--training.steps",
        "2",
        "--metrics.enable_wandb",
        "true",
        env=env,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(
        "config error: metrics.enable_wandb = true, but wandb.init failed: ValidationError: "
    ), last
    assert "'bogus'" in last and last.endswith("(to log without a server: WANDB_MODE=offline)")
    assert not (tmp_path / "dump" / RUN_ID_FILE).exists()
