"""`python -m trainer.data.prepare`: tokenize a source, or every source of a blend, into token
stores with N worker processes (trainer/data/writer.py does the writing; interrupted stores
resume, finished ones are reused).

    python -m trainer.data.prepare --dataset json --data_files 'data/*.jsonl' \
        --tokenizer_path tok.model --store_path stores/mydata --workers 8
    python -m trainer.data.prepare --dataset stdlib --data_files 'email/**' --store_path s/email
    python -m trainer.data.prepare --config blend.toml --tokenizer_path tok.model

With `--config` whose `[data]` has `[[data.mix]]` tables, each source is prepared into its
`store_path` from its own `dataset` / `data_files` (or the [data] section's), in turn, with
one tokenizer for all: a blend's sources must share it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from trainer.data.config import DataConfig
from trainer.data.writer import DEFAULT_SHARD_TOKENS, prepare_store
from trainer.errors import DataError

__all__ = ["main", "prepare_one", "prepare_store"]


def prepare_one(
    cfg: DataConfig, workers: int, shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False
) -> str:
    """Prepare the store of one source config; returns the store's path."""
    if "://" in cfg.store_path:
        return _prepare_at_url(cfg, workers, shard_tokens, overwrite)
    if cfg.dataset == "stdlib" and not (cfg.tokenizer_path and cfg.store_path):
        from trainer.data.cache import ensure_stdlib  # the cached stdlib tokenizer

        tok, store = ensure_stdlib(cfg, workers=workers)
        print(f"stdlib store ready: {store} (tokenizer {tok})", flush=True)
        return store
    if not cfg.tokenizer_path or not cfg.store_path:
        raise DataError(
            "prepare needs --tokenizer_path (train one with python -m "
            "trainer.data.train_tokenizer) and --store_path (the output directory)"
        )
    prepare_store(cfg, cfg.tokenizer_path, cfg.store_path, workers, shard_tokens, overwrite)
    return cfg.store_path


def _prepare_at_url(cfg: DataConfig, workers: int, shard_tokens: int, overwrite: bool) -> str:
    """A store at s3:// or gs://: prepared into a local staging folder under data.cache_dir
    (resumed there if interrupted), then uploaded, the manifest last (remote.py), and the
    staging folder deleted. A URL that already holds a finished store is left as it is
    unless --overwrite."""
    import hashlib
    import shutil
    from pathlib import Path

    from trainer.checkpoint import storage
    from trainer.data.remote import read_text, upload_store
    from trainer.data.store import MANIFEST

    url = cfg.store_path.rstrip("/")
    storage.check_path(url, "data.store_path")
    storage.probe(url, "data.store_path")
    if read_text(storage.join(url, MANIFEST)) is not None:
        if not overwrite:
            print(
                f"{url} already holds a finished store; left as it is (--overwrite replaces it)",
                flush=True,
            )
            return url
        storage.remove_tree(url)
    staging = (
        Path(os.path.expanduser(cfg.cache_dir))
        / "upload"
        / hashlib.sha256(url.encode()).hexdigest()[:16]
    )
    staging.parent.mkdir(parents=True, exist_ok=True)
    prepare_one(replace(cfg, store_path=str(staging)), workers, shard_tokens, overwrite=True)
    upload_store(staging, url, MANIFEST)
    shutil.rmtree(staging)
    print(f"uploaded to {url}", flush=True)
    return url


def source_configs(cfg: DataConfig) -> list[tuple[str, DataConfig]]:
    """(name, single-source config) of each source of a blend; [('', cfg)] without one."""
    if not cfg.mix:
        return [("", cfg)]
    out = []
    for src in cfg.mix:
        dataset = src.dataset or cfg.dataset
        if dataset == "synthetic":
            raise DataError(
                f"data.mix source {src.name!r}: 'synthetic' has no documents to "
                "tokenize; set its dataset (stdlib, json, text, ...)"
            )
        out.append(
            (
                src.name,
                replace(
                    cfg,
                    mix=[],
                    mix_weights=[],
                    dataset=dataset,
                    data_files=list(src.data_files),
                    store_path=src.store_path,
                ),
            )
        )
    for _name, one in out:
        one.validate()
    return out


def main() -> None:
    from trainer.data.cli import add_data_args, data_config_from_args

    parser = argparse.ArgumentParser(
        prog="python -m trainer.data.prepare", description=__doc__.split("\n\n")[0]
    )
    add_data_args(parser)
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a finished store of another source or tokenizer",
    )
    args = parser.parse_args()
    sources = source_configs(data_config_from_args(args))
    for i, (name, cfg) in enumerate(sources):
        if name:
            print(
                f"== source {i + 1}/{len(sources)} {name!r}: {cfg.dataset}"
                f"{' ' + ', '.join(cfg.data_files) if cfg.data_files else ''} -> "
                f"{cfg.store_path}",
                flush=True,
            )
        prepare_one(cfg, args.workers, args.shard_tokens, args.overwrite)
    if len(sources) > 1 or sources[0][0]:
        print(f"prepared {len(sources)} sources: {', '.join(n for n, _ in sources)}", flush=True)


if __name__ == "__main__":
    from trainer.data.cli import run_main

    run_main(main)
