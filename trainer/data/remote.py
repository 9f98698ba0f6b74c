"""Token stores on an object store (s3://, gs://): ranged reads through a bounded disk cache.

A store at a URL has the same layout as a local one (store.py). Nothing of it is downloaded
whole: the manifest is read once, the shard sizes come from one listing, the tokenizer.model
(small) is copied into the cache, and tokens are read in fixed-size blocks of a shard, each
fetched with one ranged GET the first time a window needs it.

Blocks live in `<data.block_cache_dir>/remote-blocks/` (by default a node-local folder under
the system's temporary directory, not a home folder that every node may share), named by the
shard's checksum (from the manifest), the block size and the block's index: content-addressed,
so stores and runs that share a cache folder share its blocks, and a store re-uploaded with
other content at the same URL never reads stale blocks. Each block file ends with the CRC-32 of
its bytes: a block of the wrong length or checksum (a disk fault, a file cut short) is deleted
and fetched again, never served. The folder is bounded by `data.cache_max_gib`: the bytes it
holds are counted in a small `.used` file, and only when a new block would pass the bound are
the least recently used blocks (by mtime, touched on every hit) deleted, down to 90% of it, so
the folder is scanned once per tenth of the bound written, not per block; the count and the
deletes happen under a file lock, so the ranks of a node that share the folder keep it under
the bound together. A block is written to a temporary name and renamed into place: a reader
never sees half a block; the temporary files of a writer that was killed are removed when a
cache is opened. A few of the latest blocks are also kept in memory per process
(MEMORY_BLOCKS).

Credentials and endpoints are the client libraries' own (trainer/checkpoint/storage.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from trainer.checkpoint import storage
from trainer.errors import DataError

MAX_BLOCK = 4 << 20  # one ranged GET: large enough to amortise its latency
MIN_BLOCK = 4 << 10  # a tiny bound (tests) still holds a few blocks
MEMORY_BLOCKS = 16  # per process, on top of the disk bound (<= 64 MiB)
LOW_WATER = 0.9  # an eviction frees the folder down to this share of its bound
STALE_TMP_S = 600  # a temporary block file this old, or of a dead writer, is removed
_TMP = re.compile(r"^\..+\.tmp-(\d+)$")


def node_local_dir() -> str:
    """The default block cache folder: the system's temporary directory (node-local), one per
    user."""
    return os.path.join(tempfile.gettempdir(), f"trainer-{os.getuid()}")


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
        self.stats = {
            "fetched_bytes": 0,
            "requests": 0,
            "disk_hits": 0,
            "evictions": 0,
            "bad_blocks": 0,
        }
        with _locked(self.root / ".lock"):
            self._remove_torn()

    def get(self, url: str, key: str, index: int, end: int) -> bytes:
        """Block `index` of the object at `url` (`key` names its content; `end` is the
        object's size)."""
        name = f"{key}-{self.block}-{index}"
        data = self.memory.get(name)
        if data is not None:
            self.memory.move_to_end(name)
            return data
        path = self.root / name
        start, stop = index * self.block, min(end, (index + 1) * self.block)
        data = self._read(path, stop - start)
        if data is None:
            data = self._fetch(url, start, stop)
            self._store(name, data)
        self.memory[name] = data
        if len(self.memory) > MEMORY_BLOCKS:
            self.memory.popitem(last=False)
        return data

    def _read(self, path: Path, length: int) -> bytes | None:
        """The block at `path` if it is whole (its length and CRC-32), else None; a damaged
        one is deleted (fetched again by the caller)."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        data, crc = raw[:-4], raw[-4:]
        if len(raw) != length + 4 or zlib.crc32(data).to_bytes(4, "little") != crc:
            self.stats["bad_blocks"] += 1
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            return None
        os.utime(path)  # most recently used
        self.stats["disk_hits"] += 1
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
        """Write a block (and its CRC-32), first evicting the least recently used ones if it
        would pass the bound."""
        size = len(data) + 4
        if size > self.max_bytes:
            return  # a bound below one block: read through, cache nothing
        with _locked(self.root / ".lock"):
            used = self._used()
            if used is None or used + size > self.max_bytes:
                used = self._evict(int(LOW_WATER * self.max_bytes) - size)
            tmp = self.root / f".{name}.tmp-{os.getpid()}"
            tmp.write_bytes(data + zlib.crc32(data).to_bytes(4, "little"))
            replaced = (self.root / name).stat().st_size if (self.root / name).exists() else 0
            os.replace(tmp, self.root / name)
            self._set_used(used + size - replaced)

    def _evict(self, target: int) -> int:
        """Delete the least recently used blocks until the folder holds at most `target`
        bytes (one scan); the bytes left."""
        entries = []
        for e in os.scandir(self.root):
            if e.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = e.stat()
                entries.append((st.st_mtime, st.st_size, e.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= max(target, 0):
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
                self.stats["evictions"] += 1
            total -= size
        return total

    def _used(self) -> int | None:
        try:
            return int((self.root / ".used").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _set_used(self, used: int) -> None:
        (self.root / ".used").write_text(str(max(used, 0)))

    def _remove_torn(self) -> None:
        """Temporary block files of a writer that died (or older than STALE_TMP_S) are
        removed; the count is redone at the next write."""
        now, removed = time.time(), False
        for e in os.scandir(self.root):
            m = _TMP.match(e.name)
            if m is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                if not _alive(int(m[1])) or now - e.stat().st_mtime > STALE_TMP_S:
                    os.remove(e.path)
                    removed = True
        if removed:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.root / ".used")

    def used_bytes(self) -> int:
        used = self._used()
        if used is not None:
            return used
        return sum(e.stat().st_size for e in os.scandir(self.root) if not e.name.startswith("."))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
