"""Tokenizers: a SentencePiece model or a Hugging Face `tokenizer.json` (e.g. Llama-3's own,
through the `tokenizers` library), loaded with `load_tokenizer`; and training a BPE model.

Trained models keep text exactly (identity normalisation, no dummy prefix, whitespace kept,
newline as its own piece, byte fallback for anything unseen), so decode(encode(x)) == x for
source code and for any Unicode text. Special ids are fixed: unk 0, bos 1, eos 2, pad 3.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

from trainer.data.config import MIN_TRAIN_VOCAB
from trainer.errors import ConfigError, DataError


def file_sha256(path: str | Path) -> str:
    """Content hash that identifies a tokenizer independent of where its file lives."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Tokenizer:
    """A loaded SentencePiece model with the ids the data pipeline needs."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.path = str(path)
        if not os.path.isfile(self.path):
            raise DataError(f"tokenizer not found: {self.path} (data.tokenizer_path)")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(self.path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"cannot load sentencepiece model {self.path}: {e}") from None
        self.vocab_size = self.sp.vocab_size()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        # Packed pretraining never pads, but callers (eval, generation) may want an id; fall
        # back to EOS for models trained without a pad piece, as most Llama tokenizers are.
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self._sha256: str | None = None

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = file_sha256(self.path)
        return self._sha256

    def encode_docs(
        self, texts: list[str], add_bos: bool = True, add_eos: bool = True, num_threads: int = 1
    ) -> list[list[int]]:
        """Token ids of each document, framed by BOS/EOS when the tokenizer has them."""
        ids = self.sp.encode(texts, num_threads=num_threads)
        head = [self.bos_id] if add_bos and self.bos_id >= 0 else []
        tail = [self.eos_id] if add_eos and self.eos_id >= 0 else []
        if head or tail:
            ids = [head + x + tail for x in ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i not in (self.bos_id, self.eos_id)])


def is_hf_tokenizer(path: str | Path) -> bool:
    """A Hugging Face tokenizer.json (JSON text), not a sentencepiece model (protobuf)? By
    content, since a store keeps its copy under one name whatever the kind."""
    with open(path, "rb") as fh:
        return fh.read(64).lstrip()[:1] == b"{"


def load_tokenizer(path: str | Path):
    """The tokenizer in `path`: a sentencepiece model or a Hugging Face tokenizer.json."""
    if not os.path.isfile(path):
        raise DataError(f"tokenizer not found: {path} (data.tokenizer_path)")
    return HFTokenizer(path) if is_hf_tokenizer(path) else Tokenizer(path)


# Special tokens of common tokenizer.json files without a tokenizer_config.json next to them.
_KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_KNOWN_EOS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


def hf_special_tokens(path: str | Path, tok) -> dict[str, str]:
    """bos/eos/unk/pad token strings of a tokenizer.json: from the tokenizer_config.json next
    to it when there is one, else the first known BOS/EOS name in its vocab."""
    cfg_path = Path(path).with_name("tokenizer_config.json")
    out: dict[str, str] = {}
    if cfg_path.is_file():
        import json

        cfg = json.loads(cfg_path.read_text())
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = cfg.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and tok.token_to_id(value) is not None:
                out[key] = value
    for key, names in (("bos_token", _KNOWN_BOS), ("eos_token", _KNOWN_EOS)):
        if key not in out:
            found = [n for n in names if tok.token_to_id(n) is not None]
            if found:
                out[key] = found[0]
    return out


class HFTokenizer:
    """A Hugging Face tokenizer.json with the interface of `Tokenizer`. BOS/EOS are added here
    (per data.add_bos/add_eos), never by the file's own post-processor."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as Backend

        self.path = str(path)
        try:
            self.tok = Backend.from_file(self.path)
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise DataError(f"cannot load tokenizer.json {self.path}: {e}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        special = hf_special_tokens(self.path, self.tok)
        ids = {k: self.tok.token_to_id(v) for k, v in special.items()}
        self.bos_id, self.eos_id = ids.get("bos_token", -1), ids.get("eos_token", -1)
        self.pad_id = ids.get("pad_token", self.eos_id)
        self._sha256: str | None = None

    sha256 = Tokenizer.sha256

    def encode_docs(
        self, texts: list[str], add_bos: bool = True, add_eos: bool = True, num_threads: int = 1
    ) -> list[list[int]]:
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        head = [self.bos_id] if add_bos and self.bos_id >= 0 else []
        tail = [self.eos_id] if add_eos and self.eos_id >= 0 else []
        return [head + e.ids + tail for e in encs]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(
            [i for i in ids if i not in (self.bos_id, self.eos_id)], skip_special_tokens=False
        )


def _sentences(
    docs: Iterable[str], max_chars: int, on_doc: Callable[[int, int], None] | None
) -> Iterator[str]:
    """Non-blank lines of the documents (SentencePiece trains on lines), up to max_chars."""
    n_docs = n_chars = 0
    for doc in docs:
        n_docs += 1
        for line in doc.split("\n"):
            if line.strip():
                n_chars += len(line)
                yield line
        if on_doc:
            on_doc(n_docs, n_chars)
        if n_chars >= max_chars:
            return


def train_bpe(
    docs: Iterable[str],
    vocab_size: int,
    out_path: str | Path,
    max_chars: int = 20_000_000,
    num_threads: int = 2,
    on_doc: Callable[[int, int], None] | None = None,
) -> str:
    """Train a byte-fallback BPE model on the documents and write it atomically to out_path.

    Training is deterministic for a given input (fixed seed, input not subsampled), so ranks or
    nodes that train the stdlib default independently get the same bytes and the same store."""
    import sentencepiece as spm

    if vocab_size < MIN_TRAIN_VOCAB:
        raise ConfigError(
            f"data.vocab_size = {vocab_size} is too small to train a "
            f"byte-fallback BPE tokenizer; use >= {MIN_TRAIN_VOCAB}"
        )
    counted = {"chars": 0}

    def count(n_docs: int, n_chars: int) -> None:
        counted["chars"] = n_chars
        if on_doc:
            on_doc(n_docs, n_chars)

    buf = io.BytesIO()
    spm.set_random_generator_seed(1234)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(docs, max_chars, count),
            model_writer=buf,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            character_coverage=0.9995,
            num_threads=num_threads,
            minloglevel=2,
            max_sentence_length=1 << 16,
            train_extremely_large_corpus=False,
        )
    except RuntimeError as e:
        if counted["chars"] == 0:
            raise DataError(f"empty corpus: no text to train a tokenizer for {out_path}") from None
        raise DataError(f"tokenizer training for {out_path} failed: {e}") from None
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, out_path)  # atomic: readers see the old file or the whole new one
    return str(out_path)
