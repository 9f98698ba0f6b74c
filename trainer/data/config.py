"""The `[data]` config section: where tokens come from and how they are cut into samples.

Three kinds of source, chosen by `dataset`:
- "stdlib": the .py files of this machine's Python standard library. A BPE tokenizer is trained
  on it and a token store prepared at first use, both cached under `cache_dir` (no download).
- "synthetic": a deterministic, learnable token stream; no tokenizer, vocab from `vocab_size`.
- a Hugging Face dataset: a hub name (e.g. "allenai/c4", streamed) or a builder ("json",
  "parquet", "text", "csv") reading local `data_files`. With `store_path` pointing at a store
  prepared by `python -m trainer.data.prepare`, training reads the store (exact resumes on any
  dp size); without it, documents are streamed and tokenized on the fly (per-rank resume only).

Or a blend: `[[data.mix]]` tables name prepared stores with weights (fractions of training
tokens); `data.mix_weights` overrides the weights from the command line for a new stage
(trainer/data/mix_loader.py has the order, stage changes and what a checkpoint records).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainer.config.base import opt
from trainer.errors import ConfigError

LOCAL_BUILDERS = ("json", "parquet", "text", "csv")
MIN_TRAIN_VOCAB = 320  # a trained BPE needs 256 byte-fallback pieces + specials + some merges
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # it becomes part of TensorBoard tags


@dataclass
class MixSource:
    """One `[[data.mix]]` table: a named token store and its share of the training tokens."""

    name: str = opt(
        "", "Source name, used in logs and TensorBoard tags (letters, digits, '_', '.', '-')"
    )
    store_path: str = opt(
        "",
        "Token store of this source, a directory or s3:// / gs:// URL "
        "(python -m trainer.data.prepare)",
    )
    weight: float = opt(
        1.0,
        "Share of training tokens, normalised over the sources; 0 = not "
        "trained on (still validated)",
    )
    dataset: str = opt("", "prepare only: what to tokenize into store_path; '' = data.dataset")
    data_files: list[str] = opt(
        [],
        "prepare only: local files or globs of this source "
        "(for stdlib: module globs such as 'email/**')",
    )


@dataclass
class DataConfig:
    """Where the tokens come from: the source or blend, the tokenizer, the token store,
    documents (docs/data.md)."""

    dataset: str = opt(
        "stdlib",
        "Source: 'stdlib' (Python stdlib .py files, no download), "
        "'synthetic', a HF hub name, or json/parquet/text/csv with data_files",
    )
    data_files: list[str] = opt(
        [],
        "Local files or globs for json/parquet/text/csv datasets; "
        "for stdlib, module globs under its root (e.g. 'email/**')",
    )
    dataset_config: str = opt("", "HF dataset config name (e.g. 'en' for allenai/c4); '' = none")
    split: str = opt("train", "HF split read for training (streaming and prepare)")
    val_split: str = opt(
        "",
        "HF split streamed for validation when there is no store "
        "(e.g. 'validation'); '' = hold out val_fraction of the store",
    )
    text_field: str = opt("text", "Column holding the document text")
    tokenizer_path: str = opt(
        "",
        "SentencePiece .model or Hugging Face tokenizer.json; '' = the "
        "store's own, or a BPE model trained and cached for stdlib",
    )
    vocab_size: int = opt(
        8192, "Vocab of the tokenizer trained for 'stdlib', and of 'synthetic'", min=16, max=1 << 31
    )
    store_path: str = opt(
        "",
        "Prepared token store directory or s3:// / gs:// URL (it records "
        "its own source and tokenizer); '' = stream (HF), or the cached store "
        "(stdlib)",
    )
    cache_dir: str = opt(
        "~/.cache/trainer",
        "Where the stdlib default's tokenizer and store "
        "live, and the tokenizers of stores at s3:// or gs:// URLs",
    )
    cache_max_gib: float = opt(
        10.0,
        "Bound of the block cache of stores at URLs (per "
        "block_cache_dir, shared by the ranks of a node; least recently used "
        "blocks are evicted)",
        min=0.0,
    )
    block_cache_dir: str = opt(
        "",
        "Where the blocks of stores at s3:// or gs:// URLs are cached: a node-local "
        "folder (each node holds its own bound); '' = the system's temporary "
        "directory/trainer-<uid>",
    )
    val_fraction: float = opt(
        0.01,
        "Fraction of the store's tokens (its tail) held out for split='validation'",
        min=0.0,
        max=0.5,
    )
    shuffle: bool = opt(True, "Visit windows in a seeded permutation per epoch (False: in order)")
    verify_store: str = opt(
        "auto",
        "Store check at start: 'checksums' reads every shard, "
        "'sizes' only compares file sizes, 'auto' = checksums up to 8 GiB",
        choices=("auto", "checksums", "sizes"),
    )
    prepare_workers: int = opt(
        2,
        "Worker processes used when the stdlib store is prepared at "
        "first use (the prepare CLI has its own --workers)",
        min=1,
    )
    add_bos: bool = opt(True, "Prepend the tokenizer's BOS to every document")
    add_eos: bool = opt(True, "Append the tokenizer's EOS to every document (document separator)")
    predict_document_start: bool = opt(
        True,
        "Train the first token of each document as a target, predicted at the previous "
        "document's last position (the BOS after an EOS; with add_bos = false the first text "
        "token); false masks those targets out of the loss (Megatron's eod_mask_loss)",
    )
    mix: list[MixSource] = opt(
        [],
        "A blend of token stores: [[data.mix]] tables with name, store_path, weight (docs/data.md)",
    )
    mix_weights: list[str] = opt(
        [],
        "Override the mix weights: name=weight,... (e.g. "
        "web=0.6,code=0.4); sources not named keep theirs",
    )

    def validate(self) -> None:
        """Cross-field rules; each message names the key and what would be valid."""
        self._validate_mix()
        builder = self.dataset in LOCAL_BUILDERS
        if builder and not self.data_files and not self.store_path and not self.mix:
            raise ConfigError(
                f"data.dataset = {self.dataset!r} reads local files; set "
                "data.data_files (a list of paths or globs) or data.store_path"
            )
        if self.data_files and self.dataset == "synthetic":
            raise ConfigError(
                "data.data_files is set but data.dataset = 'synthetic' "
                "does not read files; use dataset = 'json', 'parquet', 'text' "
                "or 'csv'"
            )
        if self.data_files and self.dataset == "stdlib" and not self.store_path:
            raise ConfigError(
                "data.data_files with data.dataset = 'stdlib' selects modules "
                "for a store of their own: set data.store_path"
            )
        if self.dataset == "synthetic" and (self.tokenizer_path or self.store_path):
            raise ConfigError(
                "data.dataset = 'synthetic' uses no tokenizer or store; leave "
                "data.tokenizer_path and data.store_path empty"
            )
        if (
            self.dataset == "stdlib"
            and not self.tokenizer_path
            and self.vocab_size < MIN_TRAIN_VOCAB
        ):
            raise ConfigError(
                f"data.vocab_size = {self.vocab_size} is too small to train the "
                f"stdlib tokenizer (byte fallback needs 256 ids); use >= "
                f"{MIN_TRAIN_VOCAB}"
            )
        if not self.dataset:
            raise ConfigError(
                "data.dataset is empty; use 'stdlib', 'synthetic', a HF dataset "
                "name, or json/parquet/text/csv with data_files"
            )
        if not self.text_field:
            raise ConfigError("data.text_field is empty; name the column that holds the text")
        if not self.cache_dir:
            raise ConfigError("data.cache_dir is empty; give a writable directory")

    # -- the blend ------------------------------------------------------------------------
    def _validate_mix(self) -> None:
        """Fold `mix_weights` into `mix` (the saved config then shows the weights in force)
        and check the blend: names, stores, weights."""
        if self.mix_weights and not self.mix:
            raise ConfigError(
                "data.mix_weights is set but data.mix has no sources; add "
                "[[data.mix]] tables (name, store_path, weight)"
            )
        if not self.mix:
            return
        names = [s.name for s in self.mix]
        for i, src in enumerate(self.mix):
            where = f"data.mix[{i}]"
            if not SOURCE_NAME.fullmatch(src.name):
                raise ConfigError(
                    f"{where}.name = {src.name!r} is not valid; use letters, digits, "
                    "'_', '.' or '-' (it names TensorBoard tags)"
                )
            if names.count(src.name) > 1:
                raise ConfigError(
                    f"data.mix has two sources named {src.name!r}; names must be unique"
                )
            if not src.store_path:
                raise ConfigError(
                    f"data.mix source {src.name!r} has no store_path; give the "
                    f"directory of a store made by python -m trainer.data.prepare"
                )
        for item in self.mix_weights:
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep:
                raise ConfigError(
                    f"data.mix_weights entry {item!r} is not name=weight (e.g. {names[0]}=0.5)"
                )
            if name not in names:
                raise ConfigError(
                    f"data.mix_weights names an unknown source {name!r}; the "
                    f"sources in data.mix are: {', '.join(names)}"
                )
            try:
                weight = float(value)
            except ValueError:
                raise ConfigError(
                    f"data.mix_weights: the weight of {name!r} must be a number, "
                    f"got {value.strip()!r}"
                ) from None
            self.mix[names.index(name)].weight = weight
        self.mix_weights = []
        for src in self.mix:
            if not src.weight >= 0 or src.weight == float("inf"):
                raise ConfigError(
                    f"data.mix source {src.name!r} has weight {src.weight!r}; a "
                    "weight must be a finite number >= 0 (0 drops the source)"
                )
        if sum(s.weight for s in self.mix) <= 0:
            raise ConfigError(
                f"data.mix: every weight is 0 ({', '.join(names)}); give at least "
                "one source a positive weight"
            )
        if self.store_path or self.data_files:
            key = "store_path" if self.store_path else "data_files"
            raise ConfigError(
                f"data.{key} is set together with data.mix; a blend reads the "
                f"stores of its sources: move it into a [[data.mix]] table"
            )
        if self.dataset == "synthetic":
            raise ConfigError(
                "data.dataset = 'synthetic' cannot be blended; data.mix reads token stores"
            )

    def mix_weights_by_name(self) -> dict[str, float]:
        """{name: weight} of the blend's sources (after mix_weights), in config order."""
        return {s.name: s.weight for s in self.mix}
