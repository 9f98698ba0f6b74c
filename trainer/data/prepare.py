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


def prepare_one(cfg: DataConfig, workers: int, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                overwrite: bool = False) -> str:
    """Prepare the store of one source config; returns the store's path."""
    if cfg.dataset == "stdlib" and not (cfg.tokenizer_path and cfg.store_path):
        from trainer.data.cache import ensure_stdlib  # the cached stdlib tokenizer

        tok, store = ensure_stdlib(cfg, workers=workers)
        print(f"stdlib store ready: {store} (tokenizer {tok})", flush=True)
        return store
    if not cfg.tokenizer_path or not cfg.store_path:
        raise DataError("prepare needs --tokenizer_path (train one with python -m "
                        "trainer.data.train_tokenizer) and --store_path (the output directory)")
    prepare_store(cfg, cfg.tokenizer_path, cfg.store_path, workers, shard_tokens, overwrite)
    return cfg.store_path


def source_configs(cfg: DataConfig) -> list[tuple[str, DataConfig]]:
    """(name, single-source config) of each source of a blend; [('', cfg)] without one."""
    if not cfg.mix:
        return [("", cfg)]
    out = []
    for src in cfg.mix:
        dataset = src.dataset or cfg.dataset
        if dataset == "synthetic":
            raise DataError(f"data.mix source {src.name!r}: 'synthetic' has no documents to "
                            "tokenize; set its dataset (stdlib, json, text, ...)")
        out.append((src.name, replace(cfg, mix=[], mix_weights=[], dataset=dataset,
                                      data_files=list(src.data_files),
                                      store_path=src.store_path)))
    for name, one in out:
        one.validate()
    return out


def main() -> None:
    from trainer.data.cli import add_data_args, data_config_from_args

    parser = argparse.ArgumentParser(prog="python -m trainer.data.prepare",
                                     description=__doc__.split("\n\n")[0])
    add_data_args(parser)
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a finished store of another source or tokenizer")
    args = parser.parse_args()
    sources = source_configs(data_config_from_args(args))
    for i, (name, cfg) in enumerate(sources):
        if name:
            print(f"== source {i + 1}/{len(sources)} {name!r}: {cfg.dataset}"
                  f"{' ' + ', '.join(cfg.data_files) if cfg.data_files else ''} -> "
                  f"{cfg.store_path}", flush=True)
        prepare_one(cfg, args.workers, args.shard_tokens, args.overwrite)
    if len(sources) > 1 or sources[0][0]:
        print(f"prepared {len(sources)} sources: {', '.join(n for n, _ in sources)}", flush=True)


if __name__ == "__main__":
    from trainer.data.cli import run_main

    run_main(main)
