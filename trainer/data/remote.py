"""Token stores on an object store (s3://, gs://): ranged reads through a bounded disk cache.

A store at a URL has the same layout as a local one (store.py). Nothing of it is downloaded
whole: the manifest is read once, the shard sizes come from one listing, the tokenizer.model
(small) is copied into the cache, and tokens are read in fixed-size blocks of a shard, each
fetched with one ranged GET the first time a window needs it.

Blocks live in `<data.cache_dir>/remote-blocks/`, named by the shard's checksum (from the
manifest), the block size and the block's index: content-addressed, so stores and runs that
share a cache folder share its blocks, and a store re-uploaded with other content at the same
URL never reads stale blocks. The folder is bounded by `data.cache_max_gib`: before a block is
written, the least recently used blocks (by mtime, touched on every hit) are deleted until the
new one fits; the scan and the deletes happen under a file lock, so the ranks of a node that
share the folder keep it under the bound together. A block is written to a temporary name and
renamed into place: a reader never sees half a block, and a block another rank evicted is
fetched again. A few of the latest blocks are also kept in memory per process (MEMORY_BLOCKS).

Credentials and endpoints are the client libraries' own (trainer/checkpoint/storage.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from trainer.checkpoint import storage
from trainer.errors import DataError

MAX_BLOCK = 4 << 20  # one ranged GET: large enough to amortise its latency
MIN_BLOCK = 4 << 10  # a tiny bound (tests) still holds a few blocks
MEMORY_BLOCKS = 16  # per process, on top of the disk bound (<= 64 MiB)


def block_size(max_bytes: int) -> int:
    """The block of a cache bounded by `max_bytes`: 4 MiB, smaller for a small bound (at least
    16 blocks fit), a multiple of 4 KiB so every token dtype tiles it."""
    return max(MIN_BLOCK, min(MAX_BLOCK, (max_bytes // 16) >> 12 << 12))


class BlockCache:
    """Blocks of remote files on local disk, at most `max_bytes` in all, LRU-evicted."""

    def __init__(self, root: str | Path, max_bytes: int):
        self.root = Path(os.path.expanduser(str(root))) / "remote-blocks"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(
                f"cannot create the cache folder {self.root} (data.cache_dir): {e.strerror}"
            ) from None
        self.max_bytes, self.block = int(max_bytes), block_size(int(max_bytes))
        self.memory: OrderedDict[str, bytes] = OrderedDict()
        self.stats = {"fetched_bytes": 0, "requests": 0, "disk_hits": 0, "evictions": 0}

    def get(self, url: str, key: str, index: int, end: int) -> bytes:
        """Block `index` of the object at `url` (`key` names its content; `end` is the
        object's size)."""
        name = f"{key}-{self.block}-{index}"
        data = self.memory.get(name)
        if data is not None:
            self.memory.move_to_end(name)
            return data
        path = self.root / name
        try:
            data = path.read_bytes()
            os.utime(path)  # most recently used
            self.stats["disk_hits"] += 1
        except FileNotFoundError:
            data = self._fetch(url, index * self.block, min(end, (index + 1) * self.block))
            self._store(name, data)
        self.memory[name] = data
        if len(self.memory) > MEMORY_BLOCKS:
            self.memory.popitem(last=False)
        return data

    def _fetch(self, url: str, start: int, stop: int) -> bytes:
        data = storage.filesystem(url).cat_file(url, start=start, end=stop)
        if len(data) != stop - start:
            raise DataError(
                f"short read of {url} bytes {start}-{stop}: got {len(data)}; the "
                "object changed since its manifest was written? re-upload the store"
            )
        self.stats["fetched_bytes"] += len(data)
        self.stats["requests"] += 1
        return data

    def _store(self, name: str, data: bytes) -> None:
        """Write a block, first evicting the least recently used ones until it fits."""
        if len(data) > self.max_bytes:
            return  # a bound below one block: read through, cache nothing
        with _locked(self.root / ".lock"):
            entries = []
            for e in os.scandir(self.root):
                if e.name.startswith("."):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, e.path))
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total + len(data) <= self.max_bytes:
                    break
                try:
                    os.remove(path)
                    self.stats["evictions"] += 1
                except FileNotFoundError:
                    pass
                total -= size
            tmp = self.root / f".{name}.tmp-{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, self.root / name)

    def used_bytes(self) -> int:
        return sum(e.stat().st_size for e in os.scandir(self.root) if not e.name.startswith("."))


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive flock, waited for silently (ranks take it for a few ms per block)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class RemoteShard:
    """One shard of a remote store, sliced like the ndarray of a local one: shard[a:b] is the
    tokens a..b (an ndarray), read from the blocks that hold them."""

    def __init__(self, cache: BlockCache, url: str, key: str, tokens: int, dtype: np.dtype):
        self.cache, self.url, self.key, self.dtype = cache, url, key, np.dtype(dtype)
        self.tokens, self.nbytes = int(tokens), int(tokens) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, item: slice) -> np.ndarray:
        start, stop, step = item.indices(self.tokens)
        assert step == 1, "a shard is read in contiguous runs"
        size = self.dtype.itemsize
        lo, hi = start * size, max(start, stop) * size
        block = self.cache.block
        parts = (
            [
                self.cache.get(self.url, self.key, i, self.nbytes)
                for i in range(lo // block, -(-hi // block))
            ]
            if hi > lo
            else [b""]
        )
        first = lo - (lo // block) * block
        raw = (
            parts[0][first : first + hi - lo]
            if len(parts) == 1
            else b"".join(parts)[first : first + hi - lo]
        )
        return np.frombuffer(raw, dtype=self.dtype)


# -- the store's files ---------------------------------------------------------------------
def read_text(url: str) -> str | None:
    """A small object's text, None if it is not there."""
    try:
        return storage.filesystem(url).cat_file(url).decode()
    except FileNotFoundError:
        return None


def listing(url: str) -> dict[str, int]:
    """{name: size} of the objects directly under a prefix (one paginated LIST)."""
    fs = storage.filesystem(url)
    try:
        return {
            storage.basename(e["name"]): int(e["size"])
            for e in fs.ls(url, detail=True)
            if e.get("type") != "directory"
        }
    except FileNotFoundError:
        return {}


def object_blake2b(url: str) -> str:
    """blake2b of a whole object, streamed (what store.file_blake2b is for a local file)."""
    h = hashlib.blake2b(digest_size=16)
    with storage.filesystem(url).open(url, "rb", block_size=1 << 22) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_tokenizer(url: str, sha256: str, cache_dir: str) -> str:
    """The store's tokenizer.model copied into the cache (checked against the manifest's
    sha256), once per tokenizer; its local path."""
    folder = Path(os.path.expanduser(cache_dir)) / "remote-files"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tokenizer-{sha256[:16]}.model"
    if path.is_file():
        return str(path)
    try:
        data = storage.filesystem(url).cat_file(url)
    except FileNotFoundError:
        raise DataError(f"missing {url} of the token store; re-upload the store") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DataError(
            f"{url} does not match the manifest's tokenizer sha256; re-upload the store"
        )
    tmp = folder / f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return str(path)


def upload_store(local: str | Path, url: str, manifest_name: str) -> None:
    """Copy a finished local store to a URL: the shards and tokenizer first, the manifest
    last, so a store at the URL is complete when its manifest is there."""
    fs = storage.filesystem(url)
    local = Path(local)
    names = sorted(
        p.name
        for p in local.iterdir()
        if p.is_file() and p.name != manifest_name and not p.name.startswith(".")
    )
    for name in names:
        fs.put_file(str(local / name), storage.join(url, name))
    fs.put_file(str(local / manifest_name), storage.join(url, manifest_name))
