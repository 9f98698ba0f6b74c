"""The block cache of token stores at URLs (trainer/data/remote.py), on its own: a damaged block
on disk (cut short, or a flipped byte) is fetched again, never served; a killed writer's
temporary file is removed when a cache opens; the folder stays under its bound with a scan per
tenth of the bound written, not per block; the default folder is node-local. The fetches are
counted from a byte string standing in for the object (the S3 path itself is tests/
test_object_store_data.py's and test_object_store_faults.py's)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from trainer.data import remote
from trainer.data.remote import BlockCache

OBJECT = os.urandom(1 << 20)
BIG = os.urandom(600 * 4096)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of 4 KiB blocks bounded at 64 KiB, fetching from OBJECT."""
    c = BlockCache(tmp_path, 64 << 10)
    fetched = []

    def fetch(url, start, stop):
        fetched.append((start, stop))
        return OBJECT[start:stop]

    monkeypatch.setattr(c, "_fetch", fetch)
    c.fetched = fetched
    return c


def block_file(cache: BlockCache, index: int):
    return cache.root / f"k-{cache.block}-{index}"


def get(cache: BlockCache, index: int) -> bytes:
    cache.memory.clear()  # from disk, as another process (or a restart) would read it
    return cache.get("s3://b/obj", "k", index, len(OBJECT))


def want(cache: BlockCache, index: int) -> bytes:
    return OBJECT[index * cache.block : (index + 1) * cache.block]


@pytest.mark.parametrize("damage", ["short", "flipped", "empty"])
def test_a_damaged_block_on_disk_is_fetched_again_not_served(cache, damage):
    assert get(cache, 3) == want(cache, 3) and len(cache.fetched) == 1
    path = block_file(cache, 3)
    raw = bytearray(path.read_bytes())
    if damage == "short":
        raw = raw[: len(raw) // 2]
    elif damage == "flipped":
        raw[100] ^= 0xFF
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    assert get(cache, 3) == want(cache, 3)
    assert len(cache.fetched) == 2 and cache.stats["bad_blocks"] == 1
    assert get(cache, 3) == want(cache, 3) and len(cache.fetched) == 2  # whole again: a hit


def test_a_killed_writers_temporary_file_is_removed_when_a_cache_opens(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    pid = int(dead.stdout)
    BlockCache(tmp_path, 64 << 10)
    torn = tmp_path / "remote-blocks" / f".k-4096-7.tmp-{pid}"
    torn.write_bytes(b"x" * 1000)
    mine = tmp_path / "remote-blocks" / f".k-4096-8.tmp-{os.getpid()}"  # a live writer's
    mine.write_bytes(b"y")
    BlockCache(tmp_path, 64 << 10)
    assert not torn.exists() and mine.exists()


def test_the_folder_stays_bounded_with_a_scan_per_tenth_of_the_bound(tmp_path, monkeypatch):
    """256 blocks of 4 KiB fit the bound (a 10 GiB cache holds 2,560 of 4 MiB): writing 600
    through it, the folder never passes the bound, and it is scanned about once per 25
    blocks written (an eviction frees it down to 90%), not once per block."""
    monkeypatch.setattr(remote, "MAX_BLOCK", 4096)
    c = BlockCache(tmp_path, 1 << 20)
    monkeypatch.setattr(c, "_fetch", lambda url, start, stop: BIG[start:stop])
    scans = []
    real = os.scandir

    def counted(path="."):
        scans.append(path)
        return real(path)

    monkeypatch.setattr(remote.os, "scandir", counted)
    for index in range(600):
        c.memory.clear()
        assert c.get("s3://b/big", "k", index, len(BIG)) == BIG[index * 4096 : (index + 1) * 4096]
        if index % 50 == 0 or index == 599:
            on_disk = sum(f.stat().st_size for f in c.root.iterdir() if not f.name.startswith("."))
            assert on_disk <= c.max_bytes and c.used_bytes() == on_disk
    assert c.stats["evictions"] > 300
    assert len(scans) <= 600 // 20, len(scans)


def test_the_default_folder_is_node_local():
    assert remote.node_local_dir().startswith(tempfile.gettempdir())
    assert str(os.getuid()) in remote.node_local_dir()
