"""The `[data]` config section: where tokens come from and how they are cut into samples.

Three kinds of source, chosen by `dataset`:
- "stdlib": the .py files of this machine's Python standard library. A BPE tokenizer is trained
  on it and a token store prepared at first use, both cached under `cache_dir` (no download).
- "synthetic": a deterministic, learnable token stream; no tokenizer, vocab from `vocab_size`.
- a Hugging Face dataset: a hub name (e.g. "allenai/c4", streamed) or a builder ("json",
  "parquet", "text", "csv") reading local `data_files`. With `store_path` pointing at a store
  prepared by `python -m trainer.data.prepare`, training reads the store (exact resumes on any
  dp size); without it, documents are streamed and tokenized on the fly (per-rank resume only).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config_base import opt
from trainer.errors import ConfigError

LOCAL_BUILDERS = ("json", "parquet", "text", "csv")
MIN_TRAIN_VOCAB = 320  # a trained BPE needs 256 byte-fallback pieces + specials + some merges


@dataclass
class DataConfig:
    dataset: str = opt("stdlib", "Source: 'stdlib' (Python stdlib .py files, no download), "
                       "'synthetic', a HF hub name, or json/parquet/text/csv with data_files")
    data_files: list[str] = opt([], "Local files or globs for json/parquet/text/csv datasets")
    dataset_config: str = opt("", "HF dataset config name (e.g. 'en' for allenai/c4); '' = none")
    split: str = opt("train", "HF split read for training (streaming and prepare)")
    val_split: str = opt("", "HF split streamed for validation when there is no store "
                         "(e.g. 'validation'); '' = hold out val_fraction of the store")
    text_field: str = opt("text", "Column holding the document text")
    tokenizer_path: str = opt("", "SentencePiece .model or Hugging Face tokenizer.json; '' = the "
                              "store's own, or a BPE model trained and cached for stdlib")
    vocab_size: int = opt(8192, "Vocab of the tokenizer trained for 'stdlib', and of 'synthetic'",
                          min=16, max=1 << 31)
    store_path: str = opt("", "Prepared token store directory (it records its own source and "
                          "tokenizer); '' = stream (HF), or the cached store (stdlib)")
    cache_dir: str = opt("~/.cache/trainer", "Where the stdlib default's tokenizer and store live")
    val_fraction: float = opt(0.01, "Fraction of the store's tokens (its tail) held out for "
                              "split='validation'", min=0.0, max=0.5)
    shuffle: bool = opt(True, "Visit windows in a seeded permutation per epoch (False: in order)")
    verify_store: str = opt("auto", "Store check at start: 'checksums' reads every shard, "
                            "'sizes' only compares file sizes, 'auto' = checksums up to 8 GiB",
                            choices=("auto", "checksums", "sizes"))
    prepare_workers: int = opt(2, "Worker processes used when the stdlib store is prepared at "
                               "first use (the prepare CLI has its own --workers)", min=1)
    add_bos: bool = opt(True, "Prepend the tokenizer's BOS to every document")
    add_eos: bool = opt(True, "Append the tokenizer's EOS to every document (document separator)")

    def validate(self) -> None:
        """Cross-field rules; each message names the key and what would be valid."""
        builder = self.dataset in LOCAL_BUILDERS
        if builder and not self.data_files and not self.store_path:
            raise ConfigError(f"data.dataset = {self.dataset!r} reads local files; set "
                              "data.data_files (a list of paths or globs) or data.store_path")
        if self.data_files and self.dataset in ("stdlib", "synthetic"):
            raise ConfigError(f"data.data_files is set but data.dataset = {self.dataset!r} "
                              "does not read files; use dataset = 'json', 'parquet', 'text' "
                              "or 'csv'")
        if self.dataset == "synthetic" and (self.tokenizer_path or self.store_path):
            raise ConfigError("data.dataset = 'synthetic' uses no tokenizer or store; leave "
                              "data.tokenizer_path and data.store_path empty")
        if self.dataset == "stdlib" and not self.tokenizer_path and \
                self.vocab_size < MIN_TRAIN_VOCAB:
            raise ConfigError(f"data.vocab_size = {self.vocab_size} is too small to train the "
                              f"stdlib tokenizer (byte fallback needs 256 ids); use >= "
                              f"{MIN_TRAIN_VOCAB}")
        if not self.dataset:
            raise ConfigError("data.dataset is empty; use 'stdlib', 'synthetic', a HF dataset "
                              "name, or json/parquet/text/csv with data_files")
        if not self.text_field:
            raise ConfigError("data.text_field is empty; name the column that holds the text")
        if not self.cache_dir:
            raise ConfigError("data.cache_dir is empty; give a writable directory")
