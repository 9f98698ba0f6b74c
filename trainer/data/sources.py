"""Document sources: the embedded stdlib corpus and Hugging Face datasets (hub or local files).

Every source is an iterator of document strings, optionally restricted to one part of N (a
dp rank when streaming, a worker when preparing a store). Parts are disjoint and their union
is the whole source, so N workers together tokenize every document exactly once.
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import hashlib
import logging
import os
import random
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from trainer.data.config import LOCAL_BUILDERS, DataConfig
from trainer.errors import ConfigError, DataError


# -- the embedded default: the .py files of this machine's standard library --------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# Third-party packages are not the stdlib; the test suites (20 of the 34 MB) are left out
# because they hold generated data, odd encodings and deliberately broken files, and because
# they would more than double the first-use build time for little gain.
_STDLIB_SKIP_DIRS = ("site-packages", "__pycache__", "test", "tests", "idle_test")


def stdlib_files() -> list[Path]:
    """The stdlib's .py files (without tests and site-packages), in a fixed shuffled order.

    The order is shuffled with a fixed seed so that the tail of the store, held out for
    validation, is a random sample of modules rather than the last directories alphabetically."""
    root = stdlib_root()
    if not root.is_dir():
        raise DataError(f"Python standard library not found at {root} (data.dataset = 'stdlib')")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    files.sort()
    random.Random(0).shuffle(files)
    return files


def stdlib_selection(patterns: list[str]) -> list[Path]:
    """The stdlib files whose path under the root matches one of the globs (e.g. 'email/**',
    'json/*.py'), in the shuffled order of stdlib_files(); all of them without patterns."""
    files = stdlib_files()
    if not patterns:
        return files
    root = stdlib_root()
    rel = [p.relative_to(root).as_posix() for p in files]
    keep = set()
    for pattern in patterns:
        hits = {i for i, r in enumerate(rel) if fnmatch.fnmatchcase(r, pattern)}
        if not hits:
            raise DataError(
                f"data.data_files pattern {pattern!r} matches no module of the "
                f"standard library under {root} (e.g. 'email/**', 'json/*.py')"
            )
        keep |= hits
    return [files[i] for i in sorted(keep)]


def stdlib_fingerprint(files: list[Path]) -> str:
    """Identifies this Python's stdlib corpus (version, names, sizes) without reading it."""
    h = hashlib.sha256(sys.version.encode())
    root = stdlib_root()
    for p in files:
        h.update(f"{p.relative_to(root)}:{p.stat().st_size}\n".encode())
    return h.hexdigest()


def _read_text(path: Path) -> str:
    # a few test modules are deliberately in other encodings; keep them, replaced
    return path.read_text(encoding="utf-8", errors="replace")


# -- Hugging Face datasets -----------------------------------------------------------------
def resolve_data_files(cfg: DataConfig) -> list[str]:
    """Expand data.data_files globs; a pattern that matches nothing is a missing path."""
    out: list[str] = []
    for pattern in cfg.data_files:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob.glob(expanded, recursive=True))
        if not matches:
            raise DataError(f"data file not found: {pattern} (data.data_files)")
        files = [m for m in matches if os.path.isfile(m)]
        if not files:
            raise DataError(
                f"data.data_files {pattern!r} names folders only; give the files "
                f"(e.g. {os.path.join(pattern, '*.jsonl')!r})"
            )
        out.extend(files)
    return out


def import_datasets(what: str):
    """Hugging Face `datasets`, or one config error naming what needed it and the way out."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{what} is read through Hugging Face `datasets`, which is not "
            "installed here: pip install datasets (or train from a prepared "
            "store, data.store_path, or data.dataset = 'stdlib' or "
            "'synthetic')"
        ) from None
    return datasets


def open_hf_stream(cfg: DataConfig, split: str):
    """A streaming `datasets.IterableDataset` for a hub name or a local builder + files."""
    datasets = import_datasets(f"data.dataset = {cfg.dataset!r}")

    name = cfg.dataset
    kwargs: dict = {"split": split, "streaming": True}
    if name in LOCAL_BUILDERS:
        where = ", ".join(cfg.data_files)
        # 0-byte files hold no document (the json builder raises StopIteration on one)
        kwargs["data_files"] = [f for f in resolve_data_files(cfg) if os.path.getsize(f)]
        if not kwargs["data_files"]:
            raise DataError(
                f"empty corpus: {where} (data.data_files): every file is empty (0 bytes)"
            )
    else:
        where = name
        if cfg.data_files:
            kwargs["data_files"] = cfg.data_files
    args = [name] + ([cfg.dataset_config] if cfg.dataset_config else [])
    # The json builder logs a file it cannot parse before raising; hf_documents says it once.
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(*args, **kwargs)
    except FileNotFoundError as e:
        raise DataError(f"dataset not found: {where} ({e})") from None
    except (ConnectionError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot open dataset {where} split {split!r}: {msg}") from None


def hf_documents(
    cfg: DataConfig, split: str, part: int = 0, n_parts: int = 1, ds=None
) -> Iterator[str]:
    """Texts of one part of a HF dataset (split_dataset_by_node: by files when the number of
    files divides evenly, else every n-th example)."""
    from datasets.distributed import split_dataset_by_node

    ds = ds if ds is not None else open_hf_stream(cfg, split)
    if n_parts > 1:
        ds = split_dataset_by_node(ds, rank=part, world_size=n_parts)
    for example in examples(ds, cfg):
        yield text_of(example, cfg)


def examples(ds, cfg: DataConfig) -> Iterator[dict]:
    """The examples of a HF stream; a file that cannot be read as `cfg.dataset` (not UTF-8, not
    valid json/csv/parquet) is a DataError naming it, not a traceback from pyarrow or codecs."""
    try:
        yield from ds
    except UnicodeDecodeError as e:
        raise DataError(
            f"dataset {_where(cfg)}: {_not_utf8(cfg, e)}; convert it to UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8) or leave it out of data.data_files"
        ) from None
    except ValueError as e:  # pyarrow cannot parse a json/csv/parquet file
        if not type(e).__module__.startswith("pyarrow"):
            raise
        raise DataError(
            f"dataset {_where(cfg)} is not valid {cfg.dataset}: "
            f"{str(e).splitlines()[0]} (data.dataset = {cfg.dataset!r} reads "
            f"{cfg.dataset} files)"
        ) from None


def _where(cfg: DataConfig) -> str:
    return ", ".join(cfg.data_files) if cfg.dataset in LOCAL_BUILDERS else cfg.dataset


def _not_utf8(cfg: DataConfig, error: UnicodeDecodeError) -> str:
    """Which local file is not UTF-8 text (the decoder's error does not say)."""
    files = resolve_data_files(cfg) if cfg.dataset in LOCAL_BUILDERS else []
    for path in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        try:
            with open(path, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    decoder.decode(chunk)
                    offset += len(chunk)
                decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            return f"{path} is not UTF-8 text (byte {offset + e.start})"
        except OSError:
            continue
    return f"a file is not UTF-8 text ({error.reason})"


def text_of(example: dict, cfg: DataConfig) -> str:
    """The configured text column of an example, with an error that names the column."""
    try:
        text = example[cfg.text_field]
    except KeyError:
        cols = ", ".join(sorted(example))
        raise DataError(
            f"dataset {cfg.dataset} has no column {cfg.text_field!r} "
            f"(data.text_field); columns are: {cols}"
        ) from None
    return text if isinstance(text, str) else ("" if text is None else str(text))


# -- one entry point for prepare and train_tokenizer ----------------------------------------
def documents(cfg: DataConfig, part: int = 0, n_parts: int = 1) -> Iterator[str]:
    """Documents of the configured source (stdlib or HF `cfg.split`), part `part` of n_parts."""
    if cfg.dataset == "stdlib":
        for path in stdlib_selection(cfg.data_files)[part::n_parts]:
            yield _read_text(path)
    elif cfg.dataset == "synthetic":
        raise DataError("data.dataset = 'synthetic' has no documents to tokenize")
    else:
        yield from hf_documents(cfg, cfg.split, part, n_parts)


def source_record(cfg: DataConfig) -> dict:
    """What the manifest records about the source (enough to tell two sources apart)."""
    if cfg.dataset == "stdlib":
        files = stdlib_selection(cfg.data_files)
        rec = {
            "dataset": "stdlib",
            "root": str(stdlib_root()),
            "files": len(files),
            "fingerprint": stdlib_fingerprint(files),
        }
        return {**rec, "patterns": list(cfg.data_files)} if cfg.data_files else rec
    rec = {
        "dataset": cfg.dataset,
        "dataset_config": cfg.dataset_config,
        "split": cfg.split,
        "text_field": cfg.text_field,
    }
    if cfg.data_files:
        files = resolve_data_files(cfg) if cfg.dataset in LOCAL_BUILDERS else cfg.data_files
        rec["data_files"] = [os.path.abspath(f) if os.path.exists(f) else f for f in files]
        rec["sizes"] = [os.path.getsize(f) if os.path.exists(f) else -1 for f in files]
    return rec
