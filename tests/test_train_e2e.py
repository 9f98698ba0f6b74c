"""End to end through ./run_train.sh: parity across layouts, exact resume, atomic saves."""

import re

import pytest

from tests.helpers import BASE_FP32 as BASE
from tests.helpers import losses, run_train
from tests.test_data_fixtures import corpus_dir, json_cfg, tokenizer_path  # noqa: F401


def test_parity_one_process_fsdp2_hsdp4(tmp_path):
    runs = {
        "single": run_train(tmp_path / "single", *BASE, "--training.steps", "3", nproc=1),
        "fsdp2": run_train(tmp_path / "fsdp2", *BASE, "--training.steps", "3", nproc=2),
        "hsdp2x2": run_train(tmp_path / "hsdp2x2", *BASE, "--training.steps", "3",
                             "--parallelism.data_parallel_replicate_degree", "2", nproc=4),
    }
    assert "HSDP mesh (dp_replicate=2, dp_shard=2)" in runs["hsdp2x2"].stdout
    ref = losses(tmp_path / "single")
    assert sorted(ref) == [1, 2, 3]
    for name in ("fsdp2", "hsdp2x2"):
        got = losses(tmp_path / name)
        assert got[1] == ref[1], (name, got[1], ref[1])  # same init, same data: equal step 1
        for step in (2, 3):
            assert got[step] == pytest.approx(ref[step], rel=1e-4), (name, step)


def test_resume_is_bitwise_and_survives_a_larger_world(tmp_path):
    common = [*BASE, "--checkpoint.enable", "true", "--checkpoint.interval", "4"]
    run_train(tmp_path / "straight", *common, "--training.steps", "8")
    straight = losses(tmp_path / "straight")

    run_train(tmp_path / "resumed", *common, "--training.steps", "4")
    out = run_train(tmp_path / "resumed", *common, "--training.steps", "8").stdout
    assert "resumed from" in out and "step-4" in out
    resumed = losses(tmp_path / "resumed")
    assert [resumed[s] for s in range(1, 9)] == [straight[s] for s in range(1, 9)]  # bitwise

    # The same with asynchronous saves: the background writer saw the state of step 4, not a
    # later one (the state is staged before training goes on).
    async_ = [*common, "--checkpoint.async_mode", "async"]
    run_train(tmp_path / "async", *async_, "--training.steps", "4")
    out = run_train(tmp_path / "async", *async_, "--training.steps", "8").stdout
    assert "writing in the background" in out and "resumed from" in out
    resumed = losses(tmp_path / "async")
    assert [resumed[s] for s in range(5, 9)] == [straight[s] for s in range(5, 9)]

    # An async save is committed as soon as every rank's write is done, not at the next save:
    # a crash between two saves must find the earlier one.
    out = run_train(tmp_path / "async_commit", *async_, "--training.steps", "6",
                    "--checkpoint.interval", "3").stdout
    committed = out.index("saved checkpoint " + str(tmp_path / "async_commit/checkpoint/step-3"))
    assert committed < out.index("step:     6"), out

    # A checkpoint written by 2 ranks (FSDP) continues on 4 ranks (HSDP 2x2).
    (tmp_path / "wide").mkdir()
    run_train(tmp_path / "wide", *common, "--training.steps", "4")
    run_train(tmp_path / "wide", *common, "--training.steps", "8",
              "--parallelism.data_parallel_replicate_degree", "2", nproc=4)
    wide = losses(tmp_path / "wide")
    for step in range(5, 9):
        assert wide[step] == pytest.approx(straight[step], rel=1e-4), step


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    common = [*BASE, "--checkpoint.enable", "true", "--checkpoint.interval", "2",
              "--checkpoint.keep_latest_k", "0", "--training.steps", "6"]
    crashed = run_train(tmp_path, *common, env={"TRAINER_TEST_CRASH_BEFORE_COMMIT": "4"},
                        check=False)
    assert crashed.returncode != 0
    ckpt = tmp_path / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4.partial"]
    assert (ckpt / "step-4.partial" / ".metadata").exists()  # the data was all written

    out = run_train(tmp_path, *common).stdout
    assert re.search(r"resumed from \S*step-2 \(step 2\)", out), out
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4", "step-6"]

    # Resuming with a model of another shape is a config error naming the parameter.
    other = run_train(tmp_path, *common, "--model.vocab_size", "8256", "--training.steps", "8",
                      check=False)
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [other.stderr.strip()], other.stderr
    assert other.stderr.startswith("config error: checkpoint ") and "tok_embeddings" in other.stderr


def global_batches(stdout: str) -> list[list[str]]:
    """Per step, the sample hashes of the whole global batch in dp-rank order, from the
    TRAINER_DEBUG_DATA_HASHES lines of every rank (each rank prints one line per step)."""
    per_rank: dict[int, list[list[str]]] = {}
    for dp_rank, hashes in re.findall(r"^data dp_rank (\d+) samples (\S+)$", stdout, re.M):
        per_rank.setdefault(int(dp_rank), []).append(hashes.split(","))
    steps = len(per_rank[0])
    assert all(len(v) == steps for v in per_rank.values())
    return [sum((per_rank[r][s] for r in sorted(per_rank)), []) for s in range(steps)]


def test_elastic_resume_hsdp4_to_fsdp2_sees_exactly_the_next_samples(tmp_path):
    """The data issue's elastic resume on the real corpus: 4 ranks (HSDP 2x2) for 4 steps,
    stop, resume on 2 ranks (FSDP) to step 8 == an uninterrupted 8-step run on 2 ranks."""
    common = [*BASE, "--data.dataset", "stdlib", "--data.cache_dir", str(tmp_path / "cache"),
              "--checkpoint.enable", "true", "--checkpoint.interval", "4"]
    env = {"TRAINER_DEBUG_DATA_HASHES": "1"}
    straight = run_train(tmp_path / "straight", *common, "--training.steps", "8", env=env,
                         log_rank="0,1").stdout
    first = run_train(tmp_path / "elastic", *common, "--training.steps", "4",
                      "--parallelism.data_parallel_replicate_degree", "2", nproc=4, env=env,
                      log_rank="0,1,2,3").stdout
    second = run_train(tmp_path / "elastic", *common, "--training.steps", "8", env=env,
                       log_rank="0,1").stdout
    want = global_batches(straight)
    assert len(want) == 8 and len({h for batch in want for h in batch}) == 64  # no repeats
    assert global_batches(first) == want[:4]
    assert global_batches(second) == want[4:]
    ref, got = losses(tmp_path / "straight"), losses(tmp_path / "elastic")
    for step in range(5, 9):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step


def test_streamed_source_resumes_only_on_the_same_dp_size(tmp_path, json_cfg):
    """A streamed HF source (local jsonl) keeps per-rank positions: it resumes on the same dp
    size, and on another it stops with a data error that says to prepare a store."""
    data = ["--data.dataset", "json", "--data.data_files", json_cfg.data_files[0],
            "--data.tokenizer_path", json_cfg.tokenizer_path]
    common = [*BASE, *data, "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    run_train(tmp_path, *common, "--training.steps", "2")
    same = run_train(tmp_path, *common, "--training.steps", "3").stdout
    assert re.search(r"resumed from \S*step-2", same)
    other = run_train(tmp_path, *common, "--training.steps", "4", nproc=1, check=False)
    assert other.returncode == 2
    assert other.stderr.strip().startswith("data error:"), other.stderr
    assert "dp size 2" in other.stderr and "trainer.data.prepare" in other.stderr
