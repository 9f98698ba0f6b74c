"""End to end through ./run_train.sh: parity across layouts, exact resume, atomic saves."""

import re
import shutil
from pathlib import Path

import pytest

from tests.helpers import BASE_FP32 as BASE
from tests.helpers import STDLIB, global_batches, losses, run_train, stopped_after_save

# The reference runs the tests compare with, each rank printing the hashes of its samples:
# `straight`, 2 ranks (FSDP) for 8 steps on the stdlib corpus with a checkpoint every 4 steps
# written in the background (async), and `hsdp4`, 4 ranks (HSDP 2x2) for the first 4 of them.
HASHES = {"TRAINER_DEBUG_DATA_HASHES": "1"}
ASYNC = ["--checkpoint.async_mode", "async"]


def common(cache) -> list[str]:
    return [
        *BASE,
        *STDLIB,
        "--data.cache_dir",
        str(cache),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "4",
    ]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """(dump, stdout, cache dir) of the uninterrupted reference run."""
    root = tmp_path_factory.mktemp("e2e")
    out = run_train(
        root / "straight",
        *common(root / "cache"),
        *ASYNC,
        "--training.steps",
        "8",
        env=HASHES,
        log_rank="0,1",
    ).stdout
    return root / "straight", out, root / "cache"


@pytest.fixture(scope="module")
def hsdp4(straight, tmp_path_factory):
    """(dump, stdout) of 4 steps on 4 ranks (HSDP 2x2), same data and batch, saved at step 4."""
    dump = tmp_path_factory.mktemp("hsdp4") / "run"
    out = run_train(
        dump,
        *common(straight[2]),
        "--training.steps",
        "4",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        nproc=4,
        env=HASHES,
        log_rank="0,1,2,3",
    ).stdout
    return dump, out


def stopped_at_4(run: Path, dest: Path) -> Path:
    """A copy of an 8-step run (checkpoints at 4 and 8) as if it had stopped after step 4."""
    return stopped_after_save(run, dest, 8)


def test_parity_one_process_fsdp2_hsdp4(tmp_path, straight, hsdp4):
    """One process (4 microbatches, started as a fresh process: TRAINER_FORK_RANKS=0), FSDP 2
    and HSDP 2x2 (forked ranks): the same step-1 loss, then equal to rounding."""
    single = run_train(
        tmp_path / "single",
        *common(straight[2]),
        "--training.steps",
        "3",
        nproc=1,
        env={"TRAINER_FORK_RANKS": "0"},
    )
    assert "gradient accumulation steps: 4" in single.stdout  # 8 samples, 2 per microbatch
    assert "HSDP mesh (dp_replicate=2, dp_shard=2)" in hsdp4[1]
    ref = losses(tmp_path / "single")
    assert sorted(ref) == [1, 2, 3]
    for name, got in (("fsdp2", losses(straight[0])), ("hsdp2x2", losses(hsdp4[0]))):
        assert got[1] == ref[1], (name, got[1], ref[1])  # same init, same data: equal step 1
        for step in (2, 3):
            assert got[step] == pytest.approx(ref[step], rel=1e-4), (name, step)


def test_resume_is_bitwise_and_survives_a_larger_world(tmp_path, straight):
    ref, cmn = losses(straight[0]), common(straight[2])
    assert sorted(ref) == list(range(1, 9))
    # Asynchronous saves: the background writer of step 4 saw the state of step 4 while
    # training went on (the state is staged first), and the save is committed as soon as every
    # rank's write is done, not at the next save: a crash between two saves finds step 4.
    out = straight[1]
    assert "writing in the background" in out
    committed = out.index("saved checkpoint " + str(straight[0] / "checkpoint" / "step-4"))
    assert committed < out.index("step:     8"), out

    resumed = stopped_at_4(straight[0], tmp_path / "resumed")
    out = run_train(resumed, *cmn, *ASYNC, "--training.steps", "8").stdout
    assert re.search(r"resumed from \S*step-4 \(step 4\)", out), out
    assert losses(resumed) == {s: ref[s] for s in range(5, 9)}  # bitwise
    # Relaunched at fewer steps than it has: nothing to do, and its config.toml stays the run's
    saved = (resumed / "config.toml").read_text()
    out = run_train(resumed, *cmn, "--training.steps", "6").stdout
    assert "nothing to do: already at step 8 of 6" in out, out
    assert (resumed / "config.toml").read_text() == saved and "steps = 8" in saved

    # A checkpoint written by 2 ranks (FSDP) continues on 4 ranks (HSDP 2x2).
    wide = stopped_at_4(straight[0], tmp_path / "wide")
    run_train(
        wide,
        *cmn,
        "--training.steps",
        "8",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        nproc=4,
    )
    got = losses(wide)
    assert sorted(got) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    common = [
        *BASE,
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        "--training.steps",
        "6",
    ]
    crashed = run_train(
        tmp_path, *common, env={"TRAINER_TEST_CRASH_BEFORE_COMMIT": "4"}, check=False
    )
    assert crashed.returncode == 17  # the hook's os._exit(17) on rank 0, reported in one line
    assert re.search(
        r"^error: training failed: rank 0 \(local rank 0 on \S+\) ended with exit "
        r"code 17; its output is above$",
        crashed.stderr,
        re.M,
    ), crashed.stderr
    ckpt = tmp_path / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4.partial"]
    assert (ckpt / "step-4.partial" / ".metadata").exists()  # the data was all written

    out = run_train(tmp_path, *common).stdout
    assert re.search(r"resumed from \S*step-2 \(step 2\)", out), out
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4", "step-6"]

    # Resuming with a model of another shape is a config error naming the parameter.
    other = run_train(
        tmp_path, *common, "--model.vocab_size", "8256", "--training.steps", "8", check=False
    )
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [other.stderr.strip()], other.stderr
    assert other.stderr.startswith("config error: checkpoint ") and "tok_embeddings" in other.stderr


def test_elastic_resume_hsdp4_to_fsdp2_sees_exactly_the_next_samples(tmp_path, straight, hsdp4):
    """The data issue's elastic resume on the real corpus: 4 ranks (HSDP 2x2) for 4 steps,
    stop, resume on 2 ranks (FSDP) to step 8 == an uninterrupted 8-step run on 2 ranks."""
    dump = tmp_path / "run"
    shutil.copytree(hsdp4[0], dump)
    second = run_train(
        dump, *common(straight[2]), "--training.steps", "8", env=HASHES, log_rank="0,1"
    ).stdout
    want = global_batches(straight[1])
    assert len(want) == 8 and len({h for batch in want for h in batch}) == 64  # no repeats
    assert global_batches(hsdp4[1]) == want[:4]
    assert global_batches(second) == want[4:]
    ref, got = losses(straight[0]), losses(dump)
    for step in range(5, 9):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step


@pytest.mark.needs_datasets
def test_streamed_source_resumes_only_on_the_same_dp_size(tmp_path, json_cfg):
    """A streamed HF source (local jsonl) keeps per-rank positions: it resumes on the same dp
    size, and on another it stops with a data error that says to prepare a store."""
    data = [
        "--data.dataset",
        "json",
        "--data.data_files",
        json_cfg.data_files[0],
        "--data.tokenizer_path",
        json_cfg.tokenizer_path,
    ]
    common = [*BASE, *data, "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    run_train(tmp_path, *common, "--training.steps", "2")
    same = run_train(tmp_path, *common, "--training.steps", "3").stdout
    assert re.search(r"resumed from \S*step-2", same)
    other = run_train(tmp_path, *common, "--training.steps", "4", nproc=1, check=False)
    assert other.returncode == 2
    assert other.stderr.strip().startswith("data error:"), other.stderr
    assert "dp size 2" in other.stderr and "trainer.data.prepare" in other.stderr
