"""The manifest's checksums come from the bytes as each rank writes them (no read of the
checkpoint at save time): they equal a read of the files, for DCP's real writer."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import integrity
from trainer.data.store import file_blake2b


def on_disk(folder) -> dict[str, dict]:
    return {
        n: {"bytes": os.path.getsize(folder / n), "crc32": integrity.file_checksum(folder / n)}
        for n in os.listdir(folder)
    }


def test_hashes_taken_while_writing_equal_the_files(tmp_path, monkeypatch):
    # "big": 4 MiB, checksummed on the helper thread while it is written
    state = {
        "w": torch.randn(300, 70),
        "bf16": torch.randn(5, dtype=torch.bfloat16),
        "big": torch.randn(1 << 20),
        "extra": {"step": 7, "lrs": [0.1, 0.2], "name": "x"},
    }
    writer = integrity.storage_writer(str(tmp_path), 1, 0)
    dcp.save(state, storage_writer=writer, no_dist=True)
    reads, expected = [], on_disk(tmp_path)
    monkeypatch.setattr(integrity, "file_checksum", lambda *a: reads.append(a))
    recorded = integrity.written_files(writer)
    assert reads == []  # nothing read back
    assert recorded == expected and set(recorded) == {".metadata", "__0_0.distcp"}


def test_a_stream_that_seeks_is_hashed_from_disk(tmp_path):
    fs = integrity.HashingFileSystem()
    with fs.create_stream(tmp_path / "f.bin", "wb") as stream:
        stream.write(b"a" * 100)
        stream.seek(10)
        stream.write(b"b" * 5)
    assert fs.written == {"f.bin": None}

    class Writer:
        path = str(tmp_path)

    Writer.fs = fs
    assert integrity.written_files(Writer) == on_disk(tmp_path)


def test_older_blake2b_manifests_are_still_checked(tmp_path):
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"x" * 5000)
    want = {"bytes": 5000, "blake2b": file_blake2b(path)}
    assert integrity._check_file(str(path), want, "checksums") is None
    path.write_bytes(b"x" * 4999 + b"y")
    assert (
        integrity._check_file(str(path), want, "checksums")
        == "__0_0.distcp does not match its checksum"
    )
    assert (
        integrity._check_file(
            str(path), {"bytes": 5000, "crc32": integrity.file_checksum(path)}, "checksums"
        )
        is None
    )
