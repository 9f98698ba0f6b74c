"""Batch-size ramp: the schedule's formula, its config errors, and through ./run_train.sh a
ramp that the logged global batch follows and that resumes on the same samples, bitwise."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.helpers import BASE_FP32, losses, run_train, scalars, stopped_after_save
from trainer.config.job import load_config
from trainer.errors import ConfigError
from trainer.optim.batch_schedule import batch_at

RAMP = [
    "--training.local_batch_size",
    "1",
    "--training.global_batch_size",
    "8",
    "--training.rampup_batch_start",
    "2",
    "--training.rampup_steps",
    "10",
]
EXPECTED = [2, 2, 2, 2, 4, 4, 4, 6, 6, 6, 8, 8]  # 2 + 2 * floor(6 * (s-1)/10 / 2)


def test_step_ramp_grows_in_multiples_of_the_pass():
    cfg = load_config(RAMP)
    assert [batch_at(cfg.training, s, 0, 2, 8) for s in range(1, 13)] == EXPECTED
    no_ramp = load_config([])
    assert batch_at(no_ramp.training, 1, 0, 2, 64) == 64


def test_token_ramp_depends_on_the_samples_consumed():
    cfg = load_config([*RAMP[:6], "--training.rampup_tokens", "640", "--training.seq_len", "64"])
    consumed, got = 0, []
    for step in range(1, 9):
        got.append(batch_at(cfg.training, step, consumed, 2, 8))
        consumed += got[-1]
    # 640 tokens = 10 samples of 64: progress = consumed / 10
    assert got == [2, 2, 4, 6, 8, 8, 8, 8]


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--training.rampup_batch_start", "3", "--training.rampup_steps", "5"],
            "training.rampup_batch_start = 3 must be a multiple of local_batch_size x dp size = 2",
        ),
        (
            ["--training.rampup_batch_start", "2"],
            "training.rampup_batch_start needs exactly one of training.rampup_steps or",
        ),
        (
            [
                "--training.rampup_batch_start",
                "2",
                "--training.rampup_steps",
                "5",
                "--training.rampup_tokens",
                "100",
            ],
            "training.rampup_batch_start needs exactly one",
        ),
        (["--training.rampup_steps", "5"], "training.rampup_steps / rampup_tokens set without"),
        (
            ["--training.rampup_batch_start", "16", "--training.rampup_steps", "5"],
            "training.rampup_batch_start = 16 must be a multiple of local_batch_size x dp size = 2 "
            "and at most global_batch_size = 8; valid: 2, 4, 6, 8",
        ),
    ],
)
def test_ramp_config_errors(argv, message):
    cfg = load_config(
        ["--training.local_batch_size", "1", "--training.global_batch_size", "8", *argv]
    )
    with pytest.raises(ConfigError) as e:
        cfg.resolve(2)
    assert str(e.value).startswith(message)


def per_rank(stdout: str) -> dict[str, list[str]]:
    """{dp rank: its sample hashes of each step}, from the TRAINER_DEBUG_DATA_HASHES lines."""
    out: dict[str, list[str]] = {}
    for rank, hashes in re.findall(r"^data dp_rank (\d+) samples (\S+)", stdout, re.M):
        out.setdefault(rank, []).append(hashes)
    return out


def step_batches(stdout: str) -> list[int]:
    """Samples per step across the dp ranks."""
    return [
        sum(len(h.split(",")) for h in col) for col in zip(*per_rank(stdout).values(), strict=True)
    ]


def test_ramp_is_logged_and_resumes_on_the_same_samples(tmp_path):
    env = {"TRAINER_DEBUG_DATA_HASHES": "1"}
    args = [
        *BASE_FP32,
        *RAMP,
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "5",
        "--checkpoint.keep_latest_k",
        "0",
    ]
    straight = run_train(
        tmp_path / "straight", *args, "--training.steps", "12", env=env, log_rank="0,1"
    )
    assert (
        "batch ramp: global batch 2 -> 8 sequences over 10 steps, in steps of 2" in straight.stdout
    )
    batch = scalars(tmp_path / "straight", "batch_metrics/global_batch_size")
    assert [batch[s] for s in range(1, 13)] == EXPECTED
    tokens = scalars(tmp_path / "straight", "batch_metrics/step_tokens")
    assert [tokens[s] for s in range(1, 13)] == [64 * b for b in EXPECTED]
    assert step_batches(straight.stdout) == EXPECTED
    seen = scalars(tmp_path / "straight", "n_tokens_seen")
    assert seen[12] == 64 * sum(EXPECTED)
    # a resume across the ramp (saved at step 5): the same samples, the same losses, bitwise
    run = stopped_after_save(tmp_path / "straight", tmp_path / "resumed", 10)
    shutil.rmtree(run / "checkpoint" / "step-12")
    resumed = run_train(run, *args, "--training.steps", "12", env=env, log_rank="0,1")
    want, got = per_rank(straight.stdout), per_rank(resumed.stdout)
    assert {r: v[5:] for r, v in want.items()} == got and len(got["1"]) == 7
    ref, again = losses(tmp_path / "straight"), losses(run)
    assert all(again[s] == ref[s] for s in range(6, 13)), (again, ref)
