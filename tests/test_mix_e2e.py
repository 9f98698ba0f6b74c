"""Blends end to end through ./run_train.sh: token counters that follow the weights, a source
wrapping into its next epoch, exact resumes on another layout, stage changes that never repeat
a window, and validation per source that does not depend on the world size."""

from __future__ import annotations

import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.data_fixtures import mix_stores  # noqa: F401
from tests.helpers import BASE_FP32, STDLIB, global_batches, run_train, scalars

HASHES = {"TRAINER_DEBUG_DATA_HASHES": "1"}
# 15% held out: the json source (one file, ~69 windows) keeps the 8 validation samples asked
COMMON = [
    *BASE_FP32,
    *STDLIB,
    "--data.val_fraction",
    "0.15",
    "--metrics.log_freq",
    "10",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "10",
]
VAL = [
    "--validation.enable",
    "true",
    "--validation.freq",
    "20",
    "--validation.steps",
    "2",
    "--validation.local_batch_size",
    "4",
]


def blend_toml(path: Path, stores: dict, weights: dict) -> str:
    path.write_text(
        "".join(
            f'[[data.mix]]\nname = "{n}"\nstore_path = "{stores[n]}"\nweight = {w}\n\n'
            for n, w in weights.items()
        )
    )
    return str(path)


def global_ids(stdout: str) -> list[list[str]]:
    return global_batches(stdout, "sources")


def stopped_at(run: Path, dest: Path, step: int) -> Path:
    """A copy of a finished run as if it had stopped after saving `step`."""
    shutil.copytree(run, dest)
    for ckpt in (dest / "checkpoint").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    shutil.rmtree(dest / "tb")
    return dest


@pytest.fixture(scope="module")
def straight(mix_stores, tmp_path_factory):  # noqa: F811
    """40 steps on 2 ranks, email 0.75 / json 0.25 (json, the small one, wraps at ~step
    30); saves every 10 steps; validation at 20 and 40."""
    root = tmp_path_factory.mktemp("mix_e2e")
    toml = blend_toml(root / "blend.toml", mix_stores, {"email": 0.75, "json": 0.25})
    proc = run_train(
        root / "run",
        *COMMON,
        *VAL,
        "--training.steps",
        "40",
        config=toml,
        env=HASHES,
        log_rank="0,1",
    )
    return root / "run", proc.stdout, toml


def test_token_counters_follow_the_weights_and_the_small_source_wraps(straight):
    dump, out, _ = straight
    tokens = {n: scalars(dump, f"data_metrics/tokens/{n}") for n in ("email", "json")}
    total = tokens["email"][40] + tokens["json"][40]
    assert total == 40 * 8 * 64
    assert abs(tokens["email"][40] / total - 0.75) < 0.01
    assert abs(tokens["json"][40] / total - 0.25) < 0.01
    ids = [i for step in global_ids(out) for i in step]
    assert Counter(i.split("/")[0] for i in ids) == {n: tokens[n][40] / 64 for n in tokens}
    assert len(ids) == len(set(ids))  # no window twice within its source's epoch
    wrap = re.search(
        r"^data: step (\d+): source 'json' starts epoch 1 \(all ([\d,]+) of its "
        r"windows seen 1 time; a new permutation\)$",
        out,
        re.M,
    )
    assert wrap, out[-3000:]
    first_epoch1 = next(
        s for s, step in enumerate(global_ids(out)) if any(i.startswith("json/1/") for i in step)
    )
    assert int(wrap.group(1)) == first_epoch1 + 1
    assert scalars(dump, "data_metrics/epoch/json")[40] >= 1
    assert scalars(dump, "data_metrics/epoch/email")[40] == 0
    assert re.search(r"^  email +75\.0% +.*email: [\d,]+ tokens", out, re.M)  # the summary


def test_validation_per_source_and_token_weighted_overall(straight):
    dump = straight[0]
    per = {n: scalars(dump, f"validation_metrics/{n}/loss") for n in ("email", "json")}
    overall = scalars(dump, "validation_metrics/loss")
    assert sorted(overall) == sorted(per["email"]) == sorted(per["json"]) == [20, 40]
    for step in (20, 40):  # equal sample counts of equal length: the mean of the two
        assert overall[step] == pytest.approx(
            (per["email"][step] + per["json"][step]) / 2, rel=1e-6
        )
    ppl = scalars(dump, "validation_metrics/json/perplexity")
    assert ppl[40] == pytest.approx(2.718281828 ** per["json"][40], rel=1e-5)


def test_resume_on_hsdp_2x2_trains_on_the_uninterrupted_samples(straight, tmp_path):
    dump, out, toml = straight
    run = stopped_at(dump, tmp_path / "run", 30)
    second = run_train(
        run,
        *COMMON,
        "--training.steps",
        "40",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        config=toml,
        nproc=4,
        env=HASHES,
        log_rank="0,1,2,3",
    )
    assert "resumed from" in second.stdout and "stage" not in second.stdout
    assert global_ids(second.stdout) == global_ids(out)[30:]
    hashes = re.findall(r"^data dp_rank (\d+) samples (\S+)$", second.stdout, re.M)
    assert len(hashes) == 10 * 4  # the samples line keeps the format the other tests read
    for n in ("email", "json"):
        assert (
            scalars(run, f"data_metrics/tokens/{n}")[40]
            == scalars(dump, f"data_metrics/tokens/{n}")[40]
        )


def test_stage_changes_never_repeat_a_window(straight, mix_stores, tmp_path):  # noqa: F811
    """Stage 1 at step 10: 0.75/0.25 -> 0.25/0.75 by one override; stage 2 at step 30: a
    third source added. Every sample of the 40 steps is checked."""
    dump, out, toml = straight
    run = stopped_at(dump, tmp_path / "run", 10)
    one = run_train(
        run,
        *COMMON,
        "--training.steps",
        "30",
        "--data.mix_weights",
        "email=0.25,json=0.75",
        config=toml,
        env=HASHES,
        log_rank="0,1",
    ).stdout
    assert (
        "data: resuming after step 10: stage 1 starts at sample 80: email 75.0% -> 25.0%, "
        "json 25.0% -> 75.0%; every source continues where it stopped"
    ) in one
    three = blend_toml(
        tmp_path / "three.toml", mix_stores, {"email": 0.25, "json": 0.75, "http": 0.5}
    )
    two = run_train(
        run, *COMMON, "--training.steps", "40", config=three, env=HASHES, log_rank="0,1"
    ).stdout
    assert (
        "data: resuming after step 30: stage 2 starts at sample 240: email 25.0% -> "
        "16.7%, http new 33.3%, json 75.0% -> 50.0%"
    ) in two
    ids = [
        i
        for part in (global_ids(out)[:10], global_ids(one), global_ids(two))
        for step in part
        for i in step
    ]
    assert len(ids) == len(set(ids)) == 40 * 8
    counts = Counter(i.split("/")[0] for i in ids)
    for n in ("email", "json", "http"):  # the counters go on across the stages
        assert scalars(run, f"data_metrics/tokens/{n}")[40] == counts[n] * 64
    email = scalars(run, "data_metrics/tokens/email")
    assert email[20] > scalars(dump, "data_metrics/tokens/email")[10]
    saved = (run / "config.toml").read_text()  # the effective config names the blend in force
    assert 'name = "http"' in saved and "weight = 0.5" in saved


def test_validation_is_the_same_on_1_2_and_4_ranks_by_default(mix_stores, tmp_path):  # noqa: F811
    """Default validation settings, identical weights (lr 0), fp32: the same set and value."""
    toml = blend_toml(tmp_path / "blend.toml", mix_stores, {"email": 0.5, "http": 0.5})
    got = {}
    for nproc in (1, 2, 4):
        dump = tmp_path / f"n{nproc}"
        proc = run_train(
            dump,
            *BASE_FP32,
            *STDLIB,
            "--data.val_fraction",
            "0.1",
            "--optimizer.lr",
            "0",
            "--training.steps",
            "1",
            "--validation.enable",
            "true",
            "--validation.freq",
            "1",
            config=toml,
            nproc=nproc,
        )
        assert "validation: 80 held-out samples of each source (email, http)" in proc.stdout
        got[nproc] = {
            tag: scalars(dump, tag)[1]
            for tag in (
                "validation_metrics/loss",
                "validation_metrics/email/loss",
                "validation_metrics/http/loss",
            )
        }
    for nproc in (2, 4):
        for tag, value in got[nproc].items():
            assert value == pytest.approx(got[1][tag], abs=1e-5), (nproc, tag)


def test_blend_errors_are_one_line(mix_stores, tmp_path):  # noqa: F811
    """A missing store (found by the ranks) and an unknown weight (found before launch)."""
    toml = blend_toml(
        tmp_path / "blend.toml",
        {**mix_stores, "json": str(tmp_path / "nope")},
        {"email": 1, "json": 1},
    )
    for extra, start in (
        ([], "data error: data.mix source 'json': token store not found: "),
        (
            ["--data.mix_weights", "nope=1"],
            "config error: data.mix_weights "
            "names an unknown source 'nope'; the sources in data.mix are: email, "
            "json",
        ),
    ):
        proc = run_train(
            tmp_path / "run",
            *BASE_FP32,
            *STDLIB,
            "--training.steps",
            "1",
            *extra,
            config=toml,
            check=False,
            timeout=120,
        )
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), proc.stderr[
            -2000:
        ]
