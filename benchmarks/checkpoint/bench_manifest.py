"""What the checkpoint manifest costs a save: DCP's plain writer against the trainer's, which
checksums each file's bytes as it writes them (CRC-32 on a helper thread, overlapping each
write), and against the ways before: blake2b of the bytes as written, inline (the earlier
manifest), and the plain write, then every file read back and hashed with blake2b; side by
side, interleaved run by run.

    python benchmarks/checkpoint/bench_manifest.py [--mib 1024] [--repeats 5] [--folder /tmp]

One process writes a state of `--mib` MiB of fp32 tensors (64 of them) with `dcp.save`
(`no_dist`), into `--folder` (use the file system your checkpoints go to). The figure is the
median wall time of the save in each mode and the overhead over the plain write. The page
cache is not dropped: the old way's read-back is as cheap here as it can ever be (on a shared
file system it is a cold read of another rank's file).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import append_result  # noqa: E402
from trainer.checkpoint import integrity  # noqa: E402
from trainer.data.store import file_blake2b  # noqa: E402


class _Blake2bStream:
    """The earlier manifest's way: blake2b of each write, inline on the writing thread."""

    def __init__(self, stream):
        self._stream, self._hash = stream, hashlib.blake2b(digest_size=16)

    def write(self, data) -> int:
        self._hash.update(memoryview(data).cast("B"))
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class Blake2bFileSystem(integrity.HashingFileSystem):
    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with FileSystem.create_stream(self, path, mode) as stream:
            yield _Blake2bStream(stream) if "w" in mode else stream


def save(state: dict, folder: str, mode: str) -> float:
    t0 = time.perf_counter()
    if mode in ("crc32 while written", "blake2b while written"):
        writer = integrity.storage_writer(folder, 1, 0)
        if mode == "blake2b while written":
            writer.fs = Blake2bFileSystem()
        dcp.save(state, storage_writer=writer, no_dist=True)
        integrity.written_files(writer)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
        if mode == "read back and hashed":
            for name in os.listdir(folder):
                file_blake2b(os.path.join(folder, name))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--folder", default=tempfile.gettempdir())
    a = p.parse_args()
    n = a.mib * 2**20 // 4 // 64
    state = {f"t{i}": torch.randn(n) for i in range(64)}
    modes = [
        "plain (no manifest)",
        "crc32 while written",
        "blake2b while written",
        "read back and hashed",
    ]
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.repeats):
        for mode in modes:
            folder = tempfile.mkdtemp(prefix="bench_manifest_", dir=a.folder)
            try:
                times[mode].append(save(state, folder, mode))
            finally:
                shutil.rmtree(folder)
    base = statistics.median(times[modes[0]])
    record = {"bench": "manifest", "mib": a.mib, "repeats": a.repeats}
    for mode in modes:
        med = statistics.median(times[mode])
        print(
            f"{mode:>22}: {med:6.3f} s median ({a.mib / med:7.1f} MiB/s), "
            f"{100 * (med / base - 1):+5.1f}% against the plain write"
        )
        record[mode] = round(med, 4)
    append_result(record)


if __name__ == "__main__":
    main()
