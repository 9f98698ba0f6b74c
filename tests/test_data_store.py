"""The token store: prepare (idempotent, resumable, N workers) and every bad-input error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from tests.data_fixtures import *  # noqa: F401,F403
from tests.data_fixtures import build, stdlib_texts
from tests.helpers import fork_python
from trainer.data import check_model_vocab, padded_vocab_size
from trainer.data.prepare import prepare_store
from trainer.data.store import Store
from trainer.data.tokenizer import train_bpe
from trainer.errors import DataError


def one_line(excinfo) -> str:
    msg = excinfo.value.one_line()
    assert msg.startswith("data error: ") and "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> str:
    """A real tokenizer trained on other text than the store's."""
    return train_bpe(stdlib_texts(140)[125:], 400, tmp_path_factory.mktemp("o") / "o.model", 1)


def shard_state(path) -> dict:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in Path(path).glob("*.bin")}


@pytest.mark.needs_datasets
def test_store_layout_and_manifest(store_path, tokenizer_path):
    m = json.loads((Path(store_path) / "manifest.json").read_text())
    assert m["source"]["dataset"] == "json" and len(m["source"]["data_files"]) == 4
    assert m["tokenizer"]["vocab_size"] == 512 and m["dtype"] == "uint16"
    assert m["eos_handling"]["add_eos"] and m["total_docs"] == 120
    assert len(m["shards"]) > 10 and sum(s["tokens"] for s in m["shards"]) == m["total_tokens"]
    assert (Path(store_path) / "tokenizer.model").read_bytes() == Path(tokenizer_path).read_bytes()
    store = Store(store_path)
    # windows that cross shard boundaries read the concatenated stream
    import numpy as np

    stream = np.concatenate([np.asarray(m_) for m_ in store.maps])
    starts = np.array([0, store.offsets[1] - 5, store.total_tokens - 40])
    assert (store.read(starts, 40) == np.stack([stream[s : s + 40] for s in starts])).all()
    assert stream[0] == 1 and (stream == 2).sum() == 120  # BOS first, one EOS per document


@pytest.mark.needs_datasets
def test_prepare_is_idempotent(json_cfg, store_path):
    before = shard_state(store_path)
    m = prepare_store(
        json_cfg,
        json_cfg.tokenizer_path,
        store_path,
        workers=1,
        shard_tokens=30_000,
        show_progress=False,
    )
    assert shard_state(store_path) == before and m["total_docs"] == 120


@pytest.mark.needs_datasets
def test_unfinished_store_is_resumed(json_cfg, store_path, tmp_path):
    out = tmp_path / "store"
    calls = []

    def interrupt(docs, tokens):
        calls.append(tokens)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-way

    with pytest.raises(KeyboardInterrupt):
        prepare_store(
            json_cfg,
            json_cfg.tokenizer_path,
            str(out),
            workers=1,
            shard_tokens=30_000,
            show_progress=False,
            on_progress=interrupt,
        )
    with pytest.raises(DataError, match="unfinished"):
        Store(out)
    written = shard_state(out)
    assert written
    prepare_store(
        json_cfg,
        json_cfg.tokenizer_path,
        str(out),
        workers=1,
        shard_tokens=30_000,
        show_progress=False,
    )
    after = shard_state(out)
    assert all(after[name] == state for name, state in written.items())  # kept, not redone
    assert Store(out).fingerprint == Store(store_path).fingerprint  # same as uninterrupted


@pytest.mark.needs_datasets
def test_unfinished_store_of_another_plan_is_rebuilt(json_cfg, store_path, tmp_path):
    out = tmp_path / "store"
    with pytest.raises(KeyboardInterrupt):
        prepare_store(
            json_cfg,
            json_cfg.tokenizer_path,
            str(out),
            workers=1,
            shard_tokens=10_000,
            show_progress=False,
            on_progress=lambda d, t: (_ for _ in ()).throw(KeyboardInterrupt),
        )
    prepare_store(
        json_cfg,
        json_cfg.tokenizer_path,
        str(out),
        workers=1,
        shard_tokens=30_000,
        show_progress=False,
    )
    assert Store(out).fingerprint == Store(store_path).fingerprint


@pytest.mark.needs_datasets
def test_foreign_directories_are_not_overwritten(json_cfg, store_path, tmp_path, other_tokenizer):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a token store"):
        prepare_store(json_cfg, json_cfg.tokenizer_path, str(tmp_path / "mine"))
    with pytest.raises(DataError, match="another source or tokenizer"):
        prepare_store(json_cfg, other_tokenizer, store_path, workers=1, show_progress=False)


# -- the six bad-input cases: one line, naming the path, raised by build_dataloader ---------------
@pytest.mark.needs_datasets
def test_missing_paths(store_cfg, json_cfg, tmp_path):
    with pytest.raises(DataError) as e:
        build(replace(store_cfg, store_path=str(tmp_path / "nope")))
    assert str(tmp_path / "nope") in one_line(e) and "not found" in one_line(e)
    with pytest.raises(DataError) as e:
        build(replace(json_cfg, tokenizer_path=str(tmp_path / "no.model")))
    assert str(tmp_path / "no.model") in one_line(e)
    with pytest.raises(DataError) as e:
        build(replace(json_cfg, data_files=[str(tmp_path / "missing*.jsonl")]))
    assert str(tmp_path / "missing*.jsonl") in one_line(e)
    with pytest.raises(DataError) as e:
        build(replace(store_cfg, tokenizer_path=str(tmp_path / "no.model")))
    assert str(tmp_path / "no.model") in one_line(e)


@pytest.mark.needs_datasets
@pytest.mark.parametrize("content", ['{"text": ""}\n{"text": ""}\n', ""])
def test_empty_corpus(json_cfg, tmp_path, content):
    """Documents without text, or a 0-byte file (the json builder raised StopIteration)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    cfg = replace(json_cfg, data_files=[str(empty)])
    with pytest.raises(DataError) as e:
        prepare_store(cfg, cfg.tokenizer_path, str(tmp_path / "s"), workers=1, show_progress=False)
    assert "empty corpus" in one_line(e) and str(empty) in one_line(e)
    with pytest.raises(DataError) as e:
        build(cfg)  # streaming finds out before the first step too
    assert "empty corpus" in one_line(e) and str(empty) in one_line(e)


@pytest.mark.needs_datasets
def test_documents_without_text_are_counted_apart(json_cfg, tmp_path):
    """A row with an empty, null or missing text field is stored as nothing: the manifest's
    total_docs counts the documents it holds (it counted every row), skipped_docs the rest."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"text": "def f(x):\\n    return x"}\n{"text": ""}\n{"other": 1}\n'
        '{"text": null}\n{"text": "import os"}\n'
    )
    cfg = replace(json_cfg, data_files=[str(rows)])
    m = prepare_store(cfg, cfg.tokenizer_path, str(tmp_path / "s"), workers=1, show_progress=False)
    assert (m["total_docs"], m["skipped_docs"]) == (2, 3)
    import numpy as np

    stream = np.concatenate([np.asarray(x) for x in Store(str(tmp_path / "s")).maps])
    assert (stream == 2).sum() == 2  # one EOS per stored document


@pytest.mark.needs_datasets
def test_model_vocab_mismatch(store_cfg, store_path):
    loader = build(store_cfg)
    assert loader.vocab_size == 512
    check_model_vocab(512, loader)
    check_model_vocab(padded_vocab_size(512, 384), loader)
    assert padded_vocab_size(512, 384) == 768
    with pytest.raises(DataError) as e:
        check_model_vocab(500, loader)
    assert os.path.join(store_path, "tokenizer.model") in one_line(e)


@pytest.mark.needs_datasets
def test_store_from_another_tokenizer(store_cfg, store_path, other_tokenizer):
    other = other_tokenizer
    with pytest.raises(DataError) as e:
        build(replace(store_cfg, tokenizer_path=other))
    assert store_path in one_line(e) and other in one_line(e)


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
@pytest.mark.needs_datasets
def test_truncated_or_corrupt_shard(store_cfg, store_path, tmp_path, damage):
    copy = tmp_path / "store"
    shutil.copytree(store_path, copy)
    shard = sorted(copy.glob("*.bin"))[3]
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[:-7])
    else:
        data[100:104] = b"\xff\xff\xff\xff"
        shard.write_bytes(bytes(data))
    cfg = replace(store_cfg, store_path=str(copy))
    with pytest.raises(DataError) as e:
        build(cfg)
    assert str(shard) in one_line(e) and (
        "truncated" if damage == "truncate" else "corrupt"
    ) in one_line(e)
    if damage == "corrupt":  # the cheap check for huge stores only compares sizes
        build(replace(cfg, verify_store="sizes"))


@pytest.mark.needs_datasets
def test_seq_len_longer_than_the_corpus(store_cfg, store_path):
    with pytest.raises(DataError) as e:
        build(store_cfg, seq_len=10_000_000)
    assert "longer than the corpus" in one_line(e) and store_path in one_line(e)
    with pytest.raises(DataError) as e:
        build(replace(store_cfg, val_fraction=0.0), split="validation")
    assert store_path in one_line(e)


def test_prepare_cli_reports_one_line(tmp_path):
    python, env = fork_python()
    r = subprocess.run(
        [
            python,
            "-m",
            "trainer.data.prepare",
            "--dataset",
            "json",
            "--data_files",
            str(tmp_path / "x.jsonl"),
            "--tokenizer_path",
            str(tmp_path / "t.model"),
            "--store_path",
            str(tmp_path / "s"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"data error: tokenizer not found: {tmp_path / 't.model'} (data.tokenizer_path)"
    ]
