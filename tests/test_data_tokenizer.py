"""The sentencepiece tokenizer: training (library and CLI), exact round trips, special ids."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.data_fixtures import *  # noqa: F401,F403
from tests.data_fixtures import stdlib_texts
from tests.helpers import fork_python
from trainer.data.tokenizer import Tokenizer, train_bpe
from trainer.errors import ConfigError, DataError


def test_trained_tokenizer_round_trips(tokenizer_path):
    tok = Tokenizer(tokenizer_path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (512, 1, 2, 3)
    unicode = "  x = 1\n\tdef f():\n\n    return 'héllo 世界 🙂'\n"
    samples = [stdlib_texts(3)[2][:2000], unicode, ""]
    for text in samples:
        ids = tok.encode_docs([text], add_bos=False, add_eos=False)[0]
        assert tok.decode(ids) == text
    framed = tok.encode_docs(["abc"])[0]
    assert framed[0] == tok.bos_id and framed[-1] == tok.eos_id and tok.decode(framed) == "abc"
    assert len(tok.sha256) == 64


def test_training_is_deterministic(tmp_path, tokenizer_path):
    again = train_bpe(stdlib_texts(), 512, tmp_path / "again.model", num_threads=1)
    assert Path(again).read_bytes() == Path(tokenizer_path).read_bytes()


def test_training_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.vocab_size"):
        train_bpe(["text"], 100, tmp_path / "t.model")
    with pytest.raises(DataError, match="empty corpus"):
        train_bpe(["", "   "], 400, tmp_path / "t.model")
    assert not (tmp_path / "t.model").exists()


def test_bad_model_file(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a sentencepiece model")
    with pytest.raises(DataError, match=str(bad)):
        Tokenizer(bad)


@pytest.mark.needs_datasets
def test_train_tokenizer_cli(tmp_path):
    data = tmp_path / "docs.jsonl"
    with open(data, "w") as f:
        for text in stdlib_texts(20):
            f.write(json.dumps({"body": text}) + "\n")
    out = tmp_path / "cli.model"
    python, env = fork_python()
    r = subprocess.run(
        [
            python,
            "-m",
            "trainer.data.train_tokenizer",
            "--dataset",
            "json",
            "--data_files",
            str(data),
            "--text_field",
            "body",
            "--vocab_size",
            "400",
            "--output",
            str(out),
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "read 20 docs" in r.stderr and "BPE vocab 400" in r.stderr  # progress display
    assert Tokenizer(out).vocab_size == 400
