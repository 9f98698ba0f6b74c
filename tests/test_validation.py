"""Validation through ./run_train.sh on a real token store (held-out tail): logged at the
configured steps and falling, the same value on every layout, no effect on training."""

import pytest

from tests.data_fixtures import (
    once,
    store_cfg,  # noqa: F401
)
from tests.helpers import BASE_FP32, losses, run_train, scalars

VAL = "validation_metrics/loss"


def store_args(store: str) -> list[str]:
    return [*BASE_FP32, "--data.dataset", "json", "--data.store_path", store]


# 6 samples in passes of 4 per rank: padded and masked on every layout (1: 4+2, 2 ranks: 4+2,
# 4 ranks: 4+2+0+0), so the masking is what makes the layouts agree.
VAL_ARGS = [
    "--validation.enable",
    "true",
    "--validation.freq",
    "2",
    "--validation.steps",
    "1",
    "--validation.local_batch_size",
    "4",
    "--validation.global_batch_size",
    "6",
]


@pytest.fixture(scope="session")
def val_run(store_path, tmp_path_factory):  # noqa: F811
    """FSDP on 2 ranks, 4 steps, validation at steps 2 and 4, checkpoints at 2 and 4."""

    def make():
        dump = tmp_path_factory.mktemp("val_fsdp2")
        proc = run_train(
            dump,
            *store_args(store_path),
            *VAL_ARGS,
            "--training.steps",
            "4",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
        )
        return dump, proc

    return once("val_run", make)


@pytest.mark.needs_datasets
def test_validation_logged_falling_and_training_untouched(val_run, store_path, tmp_path):
    dump, proc = val_run
    val = scalars(dump, VAL)
    assert sorted(val) == [2, 4]
    assert val[4] < val[2] - 0.05, val  # the model learns the held-out text too
    ppl = scalars(dump, "validation_metrics/perplexity")
    assert ppl[4] == pytest.approx(2.718281828 ** val[4], rel=1e-6)
    assert "validation: 6 held-out samples every 2 steps" in proc.stdout
    assert proc.stdout.count("validation: step") == 2
    # The same run without validation trains on the same samples to the same losses, bitwise.
    run_train(tmp_path, *store_args(store_path), "--training.steps", "4")
    assert losses(tmp_path) == losses(dump)
    assert scalars(tmp_path, VAL) == {}


@pytest.mark.needs_datasets
def test_validation_is_the_same_on_every_layout(val_run, store_path, tmp_path):
    """1 process and HSDP 2x2 evaluate the same 6 samples as FSDP 2 (fp32: within 1e-5)."""
    ref = scalars(val_run[0], VAL)
    for name, nproc, extra in (
        ("single", 1, []),
        ("hsdp", 4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ):
        run_train(
            tmp_path / name,
            *store_args(store_path),
            *VAL_ARGS,
            *extra,
            "--training.steps",
            "2",
            nproc=nproc,
        )
        got = scalars(tmp_path / name, VAL)
        assert sorted(got) == [2]
        assert got[2] == pytest.approx(ref[2], abs=1e-5), (name, got[2], ref[2])


@pytest.mark.needs_datasets
def test_validation_split_too_small_is_one_line(store_path, tmp_path):
    proc = run_train(
        tmp_path,
        *store_args(store_path),
        *VAL_ARGS,
        "--validation.steps",
        "100000",
        "--training.steps",
        "2",
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("data error: the validation split holds"), (
        proc.stderr
    )
    assert "validation.steps" in lines[0]
