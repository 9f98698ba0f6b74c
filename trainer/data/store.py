"""The pre-tokenized token store: reading it (memmap) and checking it before training.

Layout of a store directory (written by trainer/data/prepare.py):
    manifest.json      format, source, tokenizer (sha256, vocab, ids), EOS handling, dtype,
                       shards in order [{file, tokens, docs, blake2b}], totals
    tokenizer.model    a copy of the tokenizer it was made with (stores are self-contained)
    shard_w000_00000.bin ...   flat uint16/uint32 token ids; documents are framed by BOS/EOS
The store is one token stream (the shards concatenated in manifest order); training cuts it
into windows of seq_len+1 tokens, which may cross shard boundaries.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from trainer.errors import DataError

FORMAT, VERSION = "trainer-token-store", 1
MANIFEST, PLAN, TOKENIZER_FILE = "manifest.json", "plan.json", "tokenizer.model"
PREPARE_HINT = "python -m trainer.data.prepare"
AUTO_CHECKSUM_BYTES = 8 << 30


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_blake2b(path: str | Path) -> str:
    """Fast content checksum of a shard (blake2b runs at ~1 GB/s)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> dict:
    """The manifest of a finished store, or a DataError saying why there is none."""
    if not path.exists():
        raise DataError(f"token store not found: {path} (data.store_path)")
    manifest = path / MANIFEST
    if not manifest.is_file():
        if (path / PLAN).is_file():
            raise DataError(f"token store {path} is unfinished (its preparation was "
                            f"interrupted); rerun {PREPARE_HINT} with the same arguments to "
                            "resume it")
        raise DataError(f"{path} is not a token store (no {MANIFEST}); prepare one with "
                        f"{PREPARE_HINT}")
    try:
        m = json.loads(manifest.read_text())
        ok = m.get("format") == FORMAT and isinstance(m.get("shards"), list)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise DataError(f"corrupt store manifest {manifest}; re-prepare the store")
    if m.get("version") != VERSION:
        raise DataError(f"store {path} has format version {m.get('version')}, this trainer "
                        f"reads version {VERSION}; re-prepare it with {PREPARE_HINT}")
    return m


class Store:
    """A finished store, checked and memory-mapped."""

    def __init__(self, path: str | Path, verify: str = "auto"):
        self.path = Path(os.path.expanduser(str(path)))
        self.manifest = read_manifest(self.path)
        tok = self.manifest["tokenizer"]
        self.tokenizer_sha256, self.vocab_size = tok["sha256"], int(tok["vocab_size"])
        self.tokenizer_file = str(self.path / TOKENIZER_FILE)
        self.dtype = np.dtype(self.manifest["dtype"])
        if verify == "auto":  # reading a multi-TB store on every rank at start is too slow
            total_bytes = sum(s["tokens"] for s in self.manifest["shards"]) * self.dtype.itemsize
            verify = "checksums" if total_bytes <= AUTO_CHECKSUM_BYTES else "sizes"
        self.verified = verify
        self.maps, sizes = [], []
        for shard in self.manifest["shards"]:
            self._check_shard(shard, verify)
            if shard["tokens"]:
                # a plain ndarray view of the map: slicing a np.memmap costs ~2 us per row
                self.maps.append(np.asarray(np.memmap(self.path / shard["file"],
                                                      dtype=self.dtype, mode="r",
                                                      shape=(shard["tokens"],))))
                sizes.append(int(shard["tokens"]))
        self.sizes = np.array(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.total_tokens = int(self.offsets[-1])
        self.offset_list, self.size_list = self.offsets.tolist(), self.sizes.tolist()
        self.fingerprint = self._fingerprint()

    def _check_shard(self, shard: dict, verify: str) -> None:
        """Truncated or corrupt shards fail here, before training, naming the file."""
        file = self.path / shard["file"]
        if not file.is_file():
            raise DataError(f"missing shard {file} of token store {self.path}; re-prepare it")
        expected = int(shard["tokens"]) * self.dtype.itemsize
        size = file.stat().st_size
        if size != expected:
            raise DataError(f"truncated shard {file}: {size} bytes but the manifest says "
                            f"{shard['tokens']} tokens ({expected} bytes); re-prepare the store")
        if verify == "checksums" and file_blake2b(file) != shard["blake2b"]:
            raise DataError(f"corrupt shard {file}: checksum mismatch with the manifest; "
                            "re-prepare the store")

    def _fingerprint(self) -> str:
        """Identity of the token stream: same fingerprint, same tokens in the same order."""
        key = {"tokenizer": self.tokenizer_sha256, "dtype": self.manifest["dtype"],
               "shards": [(s["tokens"], s["blake2b"]) for s in self.manifest["shards"]]}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Token windows [len(starts), length] as int64; a window may span shards."""
        return read_rows([self], np.zeros(len(starts), dtype=np.int64), starts, length)

    def describe(self) -> str:
        src = self.manifest.get("source", {}).get("dataset", "?")
        return (f"token store {self.path} ({src}, {self.total_tokens:,} tokens, "
                f"{len(self.maps)} shards, {self.manifest['dtype']}, {self.verified} verified)")


def read_rows(stores: list[Store], which: np.ndarray, starts: np.ndarray,
              length: int) -> np.ndarray:
    """Row r: `length` tokens of stores[which[r]] from token starts[r], as int64 (a window
    may span shards). One loop over the rows, whatever the number of stores."""
    out = np.empty((len(starts), length), dtype=np.int64)
    for row, (s, start) in enumerate(zip(which.tolist(), starts.tolist())):
        store = stores[s]
        offsets, sizes = store.offset_list, store.size_list
        i = bisect.bisect_right(offsets, start) - 1
        local = start - offsets[i]
        if local + length <= sizes[i]:  # the common case: inside one shard
            out[row] = store.maps[i][local:local + length]
            continue
        filled = 0
        while filled < length:
            take = min(length - filled, sizes[i] - local)
            out[row, filled:filled + take] = store.maps[i][local:local + take]
            filled, i, local = filled + take, i + 1, 0
    return out
