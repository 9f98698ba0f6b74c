"""What a step reports and leaves behind: the logged loss weighs every token alike whatever the
ranks' token counts, and a run whose last step was skipped still ends with its checkpoint."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from tests.data_fixtures import *  # noqa: F401,F403  (the corpus and tokenizer)
from tests.data_fixtures import stdlib_texts
from tests.helpers import BASE_FP32, STDLIB, losses, run_train


@pytest.fixture(scope="module")
def short_documents_store(json_cfg, tmp_path_factory) -> str:
    """A store of short documents (5-40 characters): a window holds many document starts,
    and how many differs from window to window."""
    from trainer.data.prepare import prepare_store

    folder = tmp_path_factory.mktemp("short_docs")
    rng = random.Random(0)
    with open(folder / "docs.jsonl", "w") as fh:
        for text in stdlib_texts(8):
            while text:
                cut = rng.randint(5, 40)
                fh.write(json.dumps({"text": text[:cut]}) + "\n")
                text = text[cut:]
    cfg = replace(json_cfg, data_files=[str(folder / "docs.jsonl")])
    prepare_store(cfg, cfg.tokenizer_path, str(folder / "store"), workers=1, show_progress=False)
    return str(folder / "store")


@pytest.mark.needs_datasets
def test_logged_loss_is_token_weighted(tmp_path, short_documents_store):
    """Document starts masked out of the loss (predict_document_start = false) leave the two
    ranks different token counts: the 2-rank run logs the loss of the 1-rank run over the same
    samples, the mean over every trained token (the mean of the ranks' means is not)."""
    common = [
        *BASE_FP32,
        *STDLIB,
        "--data.store_path",
        short_documents_store,
        "--data.predict_document_start",
        "false",
        "--training.steps",
        "4",
    ]
    run_train(tmp_path / "one", *common, nproc=1)
    run_train(tmp_path / "two", *common, nproc=2)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys() == {1, 2, 3, 4}
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=0), (step, a, b)


def test_skipped_last_step_still_saves(tmp_path):
    """Step 3, the last, has a NaN loss: its optimizer step is skipped, and the run still ends
    with a checkpoint of step 3 (exit 0, one line saying so)."""
    proc = run_train(
        tmp_path,
        *BASE_FP32,
        "--training.steps",
        "3",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "10",
        env={"TRAINER_TEST_NAN_LOSS": "0:3"},
    )
    assert "step 3: skipped the optimizer step" in proc.stdout
    assert (
        "step 3, the last, skipped its optimizer step: saved its checkpoint anyway" in proc.stdout
    )
    assert (tmp_path / "checkpoint" / "step-3" / "manifest.json").is_file()
    assert "training done at step 3" in proc.stdout
