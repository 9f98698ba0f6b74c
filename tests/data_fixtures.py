"""Shared fixtures for the data tests: a real corpus (stdlib modules as jsonl), a real
sentencepiece model trained on it, and a real token store prepared from it. Everything lives in
tmp dirs; `datasets` runs offline with its own HF_HOME.

Test modules import it with `from tests.data_fixtures import *` (fixtures included)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace

import pytest
import torch

from trainer.data import DataConfig, build_dataloader

N_FILES = 4  # jsonl files, so split_dataset_by_node splits by file for 2 and 4 ranks
_BUILT: dict = {}  # fixtures imported into several modules are per module; share the builds


def once(key: str, make):
    """Build a session-wide artefact once, whichever test module asks first."""
    if key not in _BUILT:
        _BUILT[key] = make()
    return _BUILT[key]


@pytest.fixture(scope="session", autouse=True)
def hf_offline(tmp_path_factory):
    """No hub access ever: datasets offline, with a throwaway HF_HOME."""
    old = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HOME", "HF_HUB_OFFLINE")}
    os.environ.update(
        HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path_factory.mktemp("hf_home"))
    )
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def stdlib_texts(n: int = 120) -> list[str]:
    """A fixed, real corpus: the first n stdlib modules (sorted, tests excluded)."""
    from trainer.data.sources import stdlib_root

    root = stdlib_root()
    files = sorted(p for p in root.glob("*.py"))[:n]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """N_FILES jsonl files with a 'text' and an 'id' column."""

    def make():
        d = tmp_path_factory.mktemp("corpus")
        texts = stdlib_texts()
        for k in range(N_FILES):
            with open(d / f"part{k}.jsonl", "w") as f:
                for i, text in enumerate(texts[k::N_FILES]):
                    f.write(json.dumps({"text": text, "id": f"{k}-{i}"}) + "\n")
        return d

    return once("corpus", make)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    from trainer.data.tokenizer import train_bpe

    return once(
        "tokenizer",
        lambda: train_bpe(
            stdlib_texts(), 512, tmp_path_factory.mktemp("tok") / "tiny.model", num_threads=1
        ),
    )


@pytest.fixture(scope="session")
def json_cfg(corpus_dir, tokenizer_path, tmp_path_factory) -> DataConfig:
    """Streams the jsonl corpus (no store)."""
    return once(
        "json_cfg",
        lambda: DataConfig(
            dataset="json",
            data_files=[str(corpus_dir / "*.jsonl")],
            tokenizer_path=tokenizer_path,
            cache_dir=str(tmp_path_factory.mktemp("cache")),
        ),
    )


@pytest.fixture(scope="session")
def store_path(json_cfg, tmp_path_factory) -> str:
    """A store of the jsonl corpus with small shards, so windows cross shard boundaries."""
    from trainer.data.prepare import prepare_store

    def make():
        out = str(tmp_path_factory.mktemp("stores") / "tiny")
        prepare_store(
            json_cfg,
            json_cfg.tokenizer_path,
            out,
            workers=1,
            shard_tokens=30_000,
            show_progress=False,
        )
        return out

    return once("store", make)


@pytest.fixture(scope="session")
def store_cfg(json_cfg, store_path) -> DataConfig:
    return replace(json_cfg, store_path=store_path, tokenizer_path="")


def build(
    cfg: DataConfig,
    dp_rank: int = 0,
    dp_size: int = 1,
    *,
    seq_len: int = 32,
    local_batch_size: int = 2,
    global_batch_size: int = 8,
    seed: int = 0,
    split: str = "train",
):
    return build_dataloader(
        cfg,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        split=split,
    )


def run_global_batches(loaders: list, steps: int) -> list[torch.Tensor]:
    """Simulate one optimizer step per iteration on all dp ranks (one loader per rank, in rank
    order) and return each global batch as [G, seq_len+1] token windows, rank slices in order."""
    batches = []
    for _ in range(steps):
        rows = []
        for loader in loaders:
            for _ in range(loader.accum_steps if hasattr(loader, "accum_steps") else 1):
                x, y = loader.next_microbatch()
                assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one
                rows.append(torch.cat([x, y[:, -1:]], dim=1))
        batches.append(torch.cat(rows))
    return batches


def batch_hash(batch: torch.Tensor) -> str:
    return hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]


def row_hashes(batch: torch.Tensor) -> list[str]:
    return [batch_hash(row) for row in batch]


# Three stores of different sizes cut from the stdlib corpus by module globs, sharing the
# cached stdlib tokenizer (vocab 8192): ~105k, ~4.5k and ~61k tokens; json, the small one, is
# one file (~69 windows of 65 tokens), so that a blend wraps it within a few steps.
MIX_PARTS = {"email": ["email/**"], "json": ["json/__init__.py"], "http": ["http/**"]}


@pytest.fixture(scope="session")
def mix_stores(tmp_path_factory) -> dict[str, str]:
    """{name: store path} of the three stdlib-subset stores (prepared once per session)."""
    from trainer.data.prepare import prepare_one

    def make():
        root = tmp_path_factory.mktemp("mix")
        base = DataConfig(cache_dir=str(root / "cache"))
        out = {}
        for name, patterns in MIX_PARTS.items():
            out[name] = prepare_one(
                replace(base, data_files=patterns, store_path=str(root / name)), workers=1
            )
        return out

    return once("mix_stores", make)


def mix_cfg(stores: dict[str, str], weights: dict[str, float], **kw) -> DataConfig:
    """A checked blend config of some of the stores."""
    from trainer.data.config import MixSource

    cfg = DataConfig(
        mix=[MixSource(name=n, store_path=stores[n], weight=w) for n, w in weights.items()], **kw
    )
    cfg.validate()
    return cfg
