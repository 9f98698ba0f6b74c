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
            raise DataError(
                f"token store {path} is unfinished (its preparation was "
                f"interrupted); rerun {PREPARE_HINT} with the same arguments to "
                "resume it"
            )
        raise DataError(
            f"{path} is not a token store (no {MANIFEST}); prepare one with {PREPARE_HINT}"
        )
    return parse_manifest(manifest.read_text(), path, manifest)


def read_remote_manifest(url: str) -> dict:
    """read_manifest for a store at a URL: one GET (and one HEAD when it is missing)."""
    from trainer.data.remote import read_text

    text = read_text(f"{url}/{MANIFEST}")
    if text is None:
        if read_text(f"{url}/{PLAN}") is not None:
            raise DataError(
                f"token store {url} is unfinished (its upload or preparation was "
                f"interrupted); rerun {PREPARE_HINT} with the same arguments"
            )
        raise DataError(
            f"token store not found: {url} (no {MANIFEST} there); prepare one "
            f"with {PREPARE_HINT} --store_path {url}"
        )
    return parse_manifest(text, url, f"{url}/{MANIFEST}")


def parse_manifest(text: str, path, manifest) -> dict:
    """The manifest's JSON, checked for this trainer's format and version."""
    try:
        m = json.loads(text)
        ok = m.get("format") == FORMAT and isinstance(m.get("shards"), list)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise DataError(f"corrupt store manifest {manifest}; re-prepare the store")
    if m.get("version") != VERSION:
        raise DataError(
            f"store {path} has format version {m.get('version')}, this trainer "
            f"reads version {VERSION}; re-prepare it with {PREPARE_HINT}"
        )
    return m


class Store:
    """A finished store, checked and memory-mapped."""

    def __init__(
        self,
        path: str | Path,
        verify: str = "auto",
        *,
        cache_dir: str = "~/.cache/trainer",
        cache_max_gib: float = 10.0,
        block_cache_dir: str = "",
        key: str = "data.store_path",
    ):
        self.cache = None  # a remote store's BlockCache
        if "://" in str(path):
            self._open_remote(
                str(path).rstrip("/"), verify, cache_dir, cache_max_gib, key, block_cache_dir
            )
            return
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
                self.maps.append(
                    np.asarray(
                        np.memmap(
                            self.path / shard["file"],
                            dtype=self.dtype,
                            mode="r",
                            shape=(shard["tokens"],),
                        )
                    )
                )
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
            raise DataError(
                f"truncated shard {file}: {size} bytes but the manifest says "
                f"{shard['tokens']} tokens ({expected} bytes); re-prepare the store"
            )
        if verify == "checksums" and file_blake2b(file) != shard["blake2b"]:
            raise DataError(
                f"corrupt shard {file}: checksum mismatch with the manifest; re-prepare the store"
            )

    def _open_remote(
        self,
        url: str,
        verify: str,
        cache_dir: str,
        cache_max_gib: float,
        key: str,
        block_cache_dir: str,
    ) -> None:
        """A store at s3:// or gs://: the bucket probed (one config error if it cannot be
        reached), the manifest read, the sizes from one listing, the shards read on demand
        through the block cache (remote.py). 'auto' is 'sizes' here: checking checksums
        reads the whole store on every rank, so only data.verify_store = 'checksums' does."""
        from trainer.checkpoint import storage
        from trainer.data import remote

        storage.check_path(url, key)
        storage.probe(url, key)
        self.path = url
        self.manifest = read_remote_manifest(url)
        tok = self.manifest["tokenizer"]
        self.tokenizer_sha256, self.vocab_size = tok["sha256"], int(tok["vocab_size"])
        self.dtype = np.dtype(self.manifest["dtype"])
        self.verified = "sizes" if verify == "auto" else verify
        self.cache = remote.BlockCache(
            block_cache_dir or remote.node_local_dir(), int(cache_max_gib * (1 << 30))
        )
        sizes_found = remote.listing(url)
        self.maps, sizes = [], []
        for shard in self.manifest["shards"]:
            file = f"{url}/{shard['file']}"
            expected = int(shard["tokens"]) * self.dtype.itemsize
            if shard["file"] not in sizes_found:
                raise DataError(f"missing shard {file} of token store {url}; re-upload it")
            if sizes_found[shard["file"]] != expected:
                raise DataError(
                    f"truncated shard {file}: {sizes_found[shard['file']]} bytes "
                    f"but the manifest says {shard['tokens']} tokens ({expected} "
                    "bytes); re-upload the store"
                )
            if self.verified == "checksums" and remote.object_blake2b(file) != shard["blake2b"]:
                raise DataError(
                    f"corrupt shard {file}: checksum mismatch with the manifest; "
                    "re-upload the store"
                )
            if shard["tokens"]:
                self.maps.append(
                    remote.RemoteShard(
                        self.cache, file, shard["blake2b"], shard["tokens"], self.dtype
                    )
                )
                sizes.append(int(shard["tokens"]))
        self.tokenizer_file = remote.cached_tokenizer(
            f"{url}/{TOKENIZER_FILE}", self.tokenizer_sha256, cache_dir
        )
        self.sizes = np.array(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.total_tokens = int(self.offsets[-1])
        self.offset_list, self.size_list = self.offsets.tolist(), self.sizes.tolist()
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        """Identity of the token stream: same fingerprint, same tokens in the same order."""
        key = {
            "tokenizer": self.tokenizer_sha256,
            "dtype": self.manifest["dtype"],
            "shards": [(s["tokens"], s["blake2b"]) for s in self.manifest["shards"]],
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Token windows [len(starts), length] as int64; a window may span shards."""
        return read_rows([self], np.zeros(len(starts), dtype=np.int64), starts, length)

    def describe(self) -> str:
        src = self.manifest.get("source", {}).get("dataset", "?")
        return (
            f"token store {self.path} ({src}, {self.total_tokens:,} tokens, "
            f"{len(self.maps)} shards, {self.manifest['dtype']}, {self.verified} verified"
            + (
                f"; read through a {self.cache.max_bytes / (1 << 30):g} GiB block cache in "
                f"{self.cache.root}"
                if self.cache
                else ""
            )
            + ")"
        )


def read_rows(
    stores: list[Store], which: np.ndarray, starts: np.ndarray, length: int
) -> np.ndarray:
    """Row r: `length` tokens of stores[which[r]] from token starts[r], as int64 (a window
    may span shards). One loop over the rows, whatever the number of stores."""
    out = np.empty((len(starts), length), dtype=np.int64)
    for row, (s, start) in enumerate(zip(which.tolist(), starts.tolist(), strict=True)):
        store = stores[s]
        offsets, sizes = store.offset_list, store.size_list
        i = bisect.bisect_right(offsets, start) - 1
        local = start - offsets[i]
        if local + length <= sizes[i]:  # the common case: inside one shard
            out[row] = store.maps[i][local : local + length]
            continue
        filled = 0
        while filled < length:
            take = min(length - filled, sizes[i] - local)
            out[row, filled : filled + take] = store.maps[i][local : local + take]
            filled, i, local = filled + take, i + 1, 0
    return out
