"""The embedded default, built at first use: a BPE tokenizer trained on this Python's stdlib
and a token store prepared from it, cached under `[data] cache_dir`.

    <cache_dir>/stdlib/py3.11.7-<corpus fingerprint>/
        .lock                      flock: one process builds, the others wait
        tokenizer-bpe<vocab>.model trained once per vocab size (written atomically)
        store-<tokenizer sha12>/   the store, renamed into place when finished
        store-<tokenizer sha12>.partial/   while being prepared (resumed if interrupted)
        .store-<tokenizer sha12>.partial.lock   prepare's own lock (see prepare.py)

All ranks of a job call build_dataloader at once; the lock makes one of them build while the
others wait, and atomic renames mean nobody ever sees a half-written tokenizer or store, even
when a builder is killed. The corpus fingerprint changes with the Python version or stdlib
contents, so a different interpreter gets its own cache entry.
"""

from __future__ import annotations

import os
import platform
from dataclasses import replace
from pathlib import Path

from trainer.data.config import DataConfig
from trainer.data.lock import file_lock
from trainer.data.progress import Progress
from trainer.data.sources import documents, stdlib_files, stdlib_fingerprint
from trainer.data.store import MANIFEST
from trainer.data.tokenizer import file_sha256, train_bpe
from trainer.errors import DataError

STDLIB_TOKENIZER_CHARS = 10_000_000  # ~1/3 of the corpus; trains in ~2 s on 2 cores


def stdlib_cache_dir(cfg: DataConfig) -> Path:
    fingerprint = stdlib_fingerprint(stdlib_files())[:12]
    base = (
        Path(os.path.expanduser(cfg.cache_dir))
        / "stdlib"
        / f"py{platform.python_version()}-{fingerprint}"
    )
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"cannot create cache directory {base} (data.cache_dir): {e.strerror}"
        ) from None
    return base


def ensure_stdlib(
    cfg: DataConfig, workers: int | None = None, show_progress: bool = True
) -> tuple[str, str]:
    """(tokenizer path, store path) of the stdlib default, building what is missing."""
    base = stdlib_cache_dir(cfg)
    built = _built_stdlib(cfg, base)
    if built is not None:  # every rank of every later run: no lock to queue on (and no
        return built  # "waiting for another process" line while the ranks take turns)
    with file_lock(
        base / ".lock", f"waiting for another process to build the stdlib tokenizer/store in {base}"
    ):
        tok_path = _tokenizer_path(cfg, base)
        if cfg.tokenizer_path:
            if not os.path.isfile(tok_path):
                raise DataError(f"tokenizer not found: {tok_path} (data.tokenizer_path)")
        elif not os.path.isfile(tok_path):
            _train_stdlib_tokenizer(cfg, tok_path, show_progress)
        store = _store_path(cfg, base, tok_path)
        if not os.path.isfile(os.path.join(store, MANIFEST)):
            _prepare_stdlib_store(
                cfg, tok_path, store, workers or cfg.prepare_workers, show_progress
            )
    return tok_path, store


def _built_stdlib(cfg: DataConfig, base) -> tuple[str, str] | None:
    """(tokenizer, store) when both are built, else None. Safe without the lock: a store is
    named by its tokenizer's hash and exists only once finished (renamed into place), so a
    tokenizer being written hashes to no finished store."""
    tok_path = _tokenizer_path(cfg, base)
    if not os.path.isfile(tok_path):
        return None
    store = _store_path(cfg, base, tok_path)
    return (tok_path, store) if os.path.isfile(os.path.join(store, MANIFEST)) else None


def _tokenizer_path(cfg: DataConfig, base) -> str:
    return cfg.tokenizer_path or str(base / f"tokenizer-bpe{cfg.vocab_size}.model")


def _store_path(cfg: DataConfig, base, tok_path: str) -> str:
    """The store of a tokenizer: named by its hash (a new tokenizer, a new store)."""
    return cfg.store_path or str(base / f"store-{file_sha256(tok_path)[:12]}")


def _train_stdlib_tokenizer(cfg: DataConfig, out: str, show_progress: bool) -> None:
    progress = Progress(f"training stdlib tokenizer {out}", show_progress)
    # The cached tokenizer serves every stdlib store: trained on the whole corpus, whatever
    # modules this store selects (data.data_files).
    train_bpe(
        documents(replace(cfg, data_files=[])),
        cfg.vocab_size,
        out,
        max_chars=STDLIB_TOKENIZER_CHARS,
        on_doc=lambda d, c: progress.update(f"read {d:,} files, {c / 1e6:.1f}M chars"),
    )
    progress.done(f"BPE vocab {cfg.vocab_size} trained")


def _prepare_stdlib_store(
    cfg: DataConfig, tok_path: str, store: str, workers: int, show_progress: bool
) -> None:
    """Prepare into <store>.partial, then rename: a store path exists only when finished."""
    from trainer.data.writer import prepare_store

    partial = store.rstrip("/") + ".partial"
    prepare_store(
        replace(cfg, store_path=partial),
        tok_path,
        partial,
        workers=workers,
        show_progress=show_progress,
    )
    if os.path.exists(store):  # an explicit, unfinished data.store_path: replace it
        import shutil

        shutil.rmtree(store)
    os.rename(partial, store)
