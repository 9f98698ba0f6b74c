"""Inputs that used to end in a traceback, or in nothing at all, end in one line and exit 2:
through ./run_train.sh and `trainer.data.prepare`, as a user meets them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from tests.data_fixtures import *  # noqa: F401,F403  (corpus, tokenizer and store fixtures)
from tests.helpers import REPO, STDLIB, TINY, fork_python, run_train


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


# Each is refused by run_train.sh's config check, before any process starts.
BEFORE_LAUNCH = {
    "CONFIG_FILE is a directory": (
        {"CONFIG_FILE": "{tmp}"},
        [],
        "config error: job.config_file: '{tmp}' is a directory; name a .toml file",
    ),
    "TOML not UTF-8": (
        {"CONFIG_FILE": "{tmp}/latin1.toml"},
        [],
        "config error: job.config_file '{tmp}/latin1.toml' is not UTF-8 text (byte 24)",
    ),
    "dump_folder is a file": (
        {},
        ["--job.dump_folder", "{tmp}/latin1.toml"],
        "config error: job.dump_folder = '{tmp}/latin1.toml' is a file, not a folder",
    ),
    "LOG_RANK not a rank": (
        {"LOG_RANK": "foo"},
        [],
        "config error: LOG_RANK = 'foo': give the ranks whose output to show, separated by "
        "commas (e.g. 0 or 0,1), each below the world size 2",
    ),
    "LOG_RANK beyond the ranks": ({"LOG_RANK": "0,2"}, [], "config error: LOG_RANK = '0,2'"),
    # ~100 TB of activations: beyond any machine's RAM.
    "CPU batch beyond RAM": (
        {},
        ["--training.local_batch_size", "65536", "--training.seq_len", "8192"],
        "config error: training.local_batch_size = 65536 cannot fit this machine's memory: the "
        "plan needs",
    ),
}


@pytest.mark.parametrize("case", list(BEFORE_LAUNCH))
def test_refused_before_launch(tmp_path, case):
    (tmp_path / "latin1.toml").write_bytes('[job]\ndescription = "caf\xe9"\n'.encode("latin-1"))
    env, overrides, expected = BEFORE_LAUNCH[case]
    env = {k: v.format(tmp=tmp_path) for k, v in env.items()}
    t0 = time.monotonic()
    proc = run_train(
        tmp_path / "out",
        *[o.format(tmp=tmp_path) for o in overrides],
        env=env,
        check=False,
        timeout=60,
    )
    line = one_line(proc)
    assert line.startswith(expected.format(tmp=tmp_path)), line
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
    if case == "CPU batch beyond RAM":
        assert (
            "at most training.local_batch_size = " in line or "no training.local_batch_size" in line
        )


@pytest.mark.needs_datasets
def test_corpus_not_utf8_or_binary(tmp_path, tokenizer_path):
    """A latin-1 text file, in training (streamed) and in prepare; a folder of binary files
    given as text and as json to prepare; the folder itself as data_files."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(("good line\n" * 50 + "caf\xe9 au lait\n").encode("latin-1"))
    proc = run_train(
        tmp_path / "out",
        *TINY,
        "--data.dataset",
        "text",
        "--data.data_files",
        str(latin),
        "--data.tokenizer_path",
        tokenizer_path,
        check=False,
        timeout=120,
    )
    assert one_line(proc) == (
        f"data error: dataset {latin}: {latin} is not UTF-8 text (byte {50 * 10 + 3}); convert "
        "it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out of data.data_files"
    )

    binary = tmp_path / "blobs"
    binary.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        (binary / f"part{i}.bin").write_bytes(rng.integers(0, 256, 50_000, np.uint8).tobytes())

    # The four `python -m trainer.data.prepare` runs in one process that imports once and forks
    # each (tests/scripts/forkcli.py: the same command line, exit status and stderr each).
    cases = [
        ("text", str(latin)),
        ("text", f"{binary}/*"),
        ("json", f"{binary}/*"),
        ("text", str(binary)),
    ]
    argv = []
    for dataset, files in cases:
        argv += [
            "--",
            "--dataset",
            dataset,
            "--data_files",
            files,
            "--tokenizer_path",
            tokenizer_path,
            "--store_path",
            str(tmp_path / dataset),
            "--workers",
            "2",
        ]
    python, env = fork_python()  # forkcli.py itself forked from the zygote
    proc = subprocess.run(
        [
            python,
            str(REPO / "tests" / "scripts" / "forkcli.py"),
            "trainer.data.prepare",
            "--preload",
            "trainer.data.prepare,trainer.data.cli,datasets",
            *argv,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    lines = {
        case: one_line(subprocess.CompletedProcess([], r["returncode"], r["stdout"], r["stderr"]))
        for case, r in zip(cases, runs, strict=True)
    }

    def prepare(dataset: str, files: str) -> str:
        return lines[(dataset, files)]

    assert prepare("text", str(latin)).startswith(
        f"data error: dataset {latin}: {latin} is not UTF-8 text"
    )
    line = prepare("text", f"{binary}/*")
    assert (
        line.startswith(f"data error: dataset {binary}/*: {binary}/part")
        and "is not UTF-8 text" in line
    ), line
    assert prepare("json", f"{binary}/*").startswith(
        f"data error: dataset {binary}/* is not valid json: JSON parse error"
    )
    assert prepare("text", str(binary)) == (
        f"data error: data.data_files {str(binary)!r} names folders only; give the files "
        f"(e.g. {str(binary / '*.jsonl')!r})"
    )


def test_missing_datasets_is_one_line(tmp_path, tokenizer_path):
    """Without Hugging Face `datasets` (the GPU machines have none), a text corpus and a hub eval
    task are one config error naming the key and the way out, not an import traceback per rank.
    A `datasets` package that fails to import stands in for the missing one."""
    shadow = tmp_path / "shadow" / "datasets"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'datasets'\")\n")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a line of text\n" * 200)
    proc = run_train(
        tmp_path / "out",
        *TINY,
        "--data.dataset",
        "text",
        "--data.data_files",
        str(corpus),
        "--data.tokenizer_path",
        tokenizer_path,
        check=False,
        timeout=120,
        env={"PYTHONPATH": f"{shadow.parent}{os.pathsep}{REPO}"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert one_line(proc) == (
        "config error: data.dataset = 'text' is read through Hugging Face `datasets`, which is "
        "not installed here: pip install datasets (or train from a prepared store, "
        "data.store_path, or data.dataset = 'stdlib' or 'synthetic')"
    )


def test_truncated_safetensors(tmp_path):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.embed_tokens.weight": torch.zeros(256, 64)}, folder / "model.safetensors")
    os.truncate(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size // 2)
    proc = run_train(
        tmp_path / "out",
        *TINY,
        "--checkpoint.initial_load_path",
        str(folder),
        "--checkpoint.initial_load_in_hf",
        check=False,
        timeout=120,
    )
    assert one_line(proc) == (
        f"config error: {folder}/model.safetensors cannot be read as safetensors, truncated or "
        "damaged (Error while deserializing header: incomplete metadata, file not fully "
        "covered); copy or export it again"
    )


@pytest.mark.needs_datasets
def test_token_ids_beyond_the_vocab_with_sizes_only(tmp_path, store_path):
    """A shard overwritten with ids the tokenizer never makes (sizes intact): with
    verify_store = 'sizes' the first batch that reads it stops the run in one line."""
    store = tmp_path / "store"
    shutil.copytree(store_path, store)
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16"
    for shard in manifest["shards"]:
        path = store / shard["file"]
        path.write_bytes(np.full(path.stat().st_size // 2, 60_000, np.uint16).tobytes())
    proc = run_train(
        tmp_path / "out",
        *TINY,
        *STDLIB,
        "--data.store_path",
        str(store),
        "--data.verify_store",
        "sizes",
        "--training.steps",
        "2",
        check=False,
        timeout=120,
    )
    line = one_line(proc)
    assert (
        line.startswith("data error: token id 60000 in samples ")
        and f"of {store} is beyond its vocabulary of 512: a damaged shard" in line
    ), line
