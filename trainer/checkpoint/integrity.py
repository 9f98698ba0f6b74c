"""Checkpoint integrity: a manifest of what a committed checkpoint holds, checked before loading.

Before `step-N.partial` is renamed to `step-N`, rank 0 writes `manifest.json`: the step, a
fingerprint of the model's parameter shapes, and each file's size and CRC-32. Each rank
checksums the files it writes as it writes them (HashingFileSystem: no read of the checkpoint,
the CRC of each write computed on a helper thread while the bytes go to the file, and in an
async save on the writer's thread), and the commit gathers the records. The manifest guards
against damage (truncation, bit rot, a partial copy), not tampering (checkpoint/safe_load.py
refuses code): a CRC-32 (zlib, ~3 GB/s) suffices and costs a save almost nothing; manifests
of older checkpoints carry blake2b checksums, still checked. At load the ranks again
split the files: sizes are always compared, checksums as `checkpoint.verify` says ('auto' =
checksums when the checkpoint is at most AUTO_CHECKSUM_BYTES, like the token store's rule).

A checkpoint written before manifests existed has none and no MARKER_KEY entry in its DCP
metadata; it is checked against the extents its `.metadata` records (every referenced file
exists and is long enough) and loads with a note. A new checkpoint whose manifest is gone is
damaged.

Every function here is rank-local and returns a problem string instead of raising, so the
callers can agree across ranks with one collective (see Checkpointer).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint.filesystem import FileSystem

from trainer.checkpoint import safe_load, storage
from trainer.data.store import file_blake2b
from trainer.health import faults

MANIFEST = "manifest.json"
FORMAT = "trainer-checkpoint"
VERSION = 1
# A tiny entry saved in every checkpoint's DCP state (never loaded): its presence in
# `.metadata` says the checkpoint was written with a manifest.
MARKER_KEY = "integrity"
AUTO_CHECKSUM_BYTES = 8 << 30
CHECKSUM = "crc32"  # the manifest's key (older manifests: "blake2b")
OVERLAP_BYTES = 1 << 20  # writes at least this large are checksummed on the helper thread
# Testing hook: "STEP:ERRNO[:RANK]" makes the storage writer of step STEP's save raise that OS
# error (on RANK, default 0), as a full or broken file system would, sync or async.
LEGACY = "legacy"  # the note returned for a checkpoint without a manifest


def marker() -> dict:
    return {MARKER_KEY: {"version": VERSION}}


def model_fingerprint(model) -> str:
    """A short hash of every parameter's name and shape (what a checkpoint must fit): the
    whole model's, also where a rank holds only its pipeline stages (`whole_model_shapes`)."""
    shapes = (
        model.whole_model_shapes()
        if hasattr(model, "whole_model_shapes")
        else ((name, p.shape) for name, p in model.named_parameters())
    )
    text = ";".join(f"{name}:{tuple(shape)}" for name, shape in shapes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Testing hook: after a resume, print a digest of the loaded weights (a full gather: tests only).
DIGEST_ENV = "TRAINER_DEBUG_WEIGHT_DIGEST"


def weights_digest(named_tensors) -> str:
    """sha1 of (name, full tensor bytes) in name order; DTensors are gathered (a collective:
    every rank calls it). The same for a model on any layout and for a checkpoint's tensors
    loaded on one process (tests: the loaded weights are the saved ones). Under a process
    group every rank's names are gathered: pipeline stages hold different parameters."""
    import torch.distributed as dist

    per_name = {}
    for name, t in named_tensors:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        one = hashlib.sha1(name.encode())
        one.update(full.detach().float().cpu().contiguous().numpy().tobytes())
        per_name[name] = one.hexdigest()
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, per_name)
        per_name = {k: v for rank_names in every for k, v in rank_names.items()}
    text = ";".join(f"{name}:{per_name[name]}" for name in sorted(per_name))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def saved(model):
    """(name, tensor) of what a checkpoint holds of `model`: its parameters and persistent
    buffers (e.g. MoE balancing biases)."""
    yield from model.named_parameters()
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _my_share(names: list[str], rank: int, world: int) -> list[str]:
    return [name for i, name in enumerate(sorted(names)) if i % world == rank]


# ------------------------------------------------------------------------------------- save
def unrecorded(folder: str, recorded: dict[str, dict]) -> dict[str, dict]:
    """{file: {bytes, crc32}} of the folder's files that no rank's writer recorded (none,
    with DCP's writer as it is: a safety net, read by rank 0; raises OSError)."""
    names = [n for n in storage.listdir(folder) if n != MANIFEST and n not in recorded]
    return {
        name: {
            "bytes": storage.size(storage.join(folder, name)),
            CHECKSUM: file_checksum(storage.join(folder, name)),
        }
        for name in names
    }


def write_manifest(folder: str, step: int, fingerprint: str, files: dict[str, dict]) -> None:
    """Write `manifest.json` durably (temp file, fsync, rename; on a store one object);
    raises OSError."""
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model_fingerprint": fingerprint,
        "files": dict(sorted(files.items())),
    }
    storage.write_durably(storage.join(folder, MANIFEST), json.dumps(manifest, indent=1))


def storage_writer(path: str, step: int, rank: int, threads: int = 1):
    """DCP's writer for a folder or URL (its rank's share in `threads` files written at once),
    hashing what it writes (HashingFileSystem); or (an injected fault, health/faults.py) one
    that fails like a broken disk."""
    if storage.is_url(path):
        writer = storage.dcp_writer(path, _hashing_fsspec_class(), threads)
    else:
        writer = storage.dcp_writer(path, HashingFileSystem)
    err = faults.armed().save_fails(step)
    if err is not None:
        writer.write_data = functools.partial(_fail, storage.join(path, "__injected.distcp"), err)
    elif faults.armed().save_hold_s:
        writer.write_data = functools.partial(_held, writer.write_data, faults.armed().save_hold_s)
    return writer


def written_files(writer) -> dict[str, dict]:
    """{file: {bytes, crc32}} of the files this rank's writer wrote, checksummed as it wrote
    them; a file it wrote but could not hash as a stream (a seek) is read back here."""
    fs = getattr(writer, "fs", None)
    records = dict(getattr(fs, "written", {}))
    for name, record in records.items():
        if record is None:
            path = storage.join(str(writer.path), name)
            records[name] = {"bytes": storage.size(path), CHECKSUM: file_checksum(path)}
    return records


class _Hashing:
    """A DCP file system (local or fsspec) with each file's size and CRC-32 taken from the
    bytes as they are written: the manifest needs no read of the checkpoint, and in an async
    save the hashing runs on the writer's thread, off the training loop. Each rank records only
    the files it wrote (rank 0 also `.metadata`, through its temporary name)."""

    def __init__(self):
        super().__init__()
        self.written: dict[str, dict | None] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            tee = _HashingStream(stream)
            yield tee
        self.written[storage.basename(path)] = tee.record()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        record = self.written.pop(storage.basename(path), None)
        if record is not None:
            self.written[storage.basename(new_path)] = record


class HashingFileSystem(_Hashing, FileSystem):
    """DCP's local file system, hashing what it writes."""


@functools.cache
def _hashing_fsspec_class():
    """DCP's fsspec file system, hashing what it writes (its import needs fsspec)."""
    return type("HashingFsspecFileSystem", (_Hashing, storage.fsspec_base()), {})


class _HashingStream:
    """A write stream that checksums what goes through it; anything else goes to the file.
    Each write's CRC runs on a helper thread while this thread writes the same bytes (zlib and
    the write both release the GIL), and is done before `write` returns: the caller may reuse
    its buffer then."""

    def __init__(self, stream):
        self._stream, self._crc, self._bytes, self._sought = stream, 0, 0, False
        self._pool: ThreadPoolExecutor | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) < OVERLAP_BYTES:
            self._crc = zlib.crc32(view, self._crc)
            written = self._stream.write(data)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-crc")
            crc = self._pool.submit(zlib.crc32, view, self._crc)
            written = self._stream.write(data)
            self._crc = crc.result()
        self._bytes += len(view)
        return written

    def seek(self, *args):  # not sequential: this file is checksummed from disk instead
        self._sought = True
        return self._stream.seek(*args)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def record(self) -> dict | None:
        if self._pool is not None:
            self._pool.shutdown()
        return None if self._sought else {"bytes": self._bytes, CHECKSUM: f"{self._crc:08x}"}


def file_checksum(path: str, kind: str = "crc32") -> str:
    """A file's checksum as the manifest records it: CRC-32, or blake2b (older manifests)."""
    if kind == "blake2b":
        return file_blake2b(path)
    crc = 0
    with storage.open_file(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _fail(target: str, err: int, plan, planner):
    raise OSError(err, os.strerror(err), target)


def _held(write_data, seconds: float, plan, planner):
    """`write_data` of a save held open `seconds` (an injected slow disk): half before this
    rank writes its files, half after they are written."""
    time.sleep(seconds / 2)
    written = write_data(plan, planner)
    written.wait()
    time.sleep(seconds / 2)
    return written


def describe_save_error(exc: BaseException, folder: str) -> str:
    """The OS error behind a failed DCP save (DCP wraps each rank's error), as one phrase.
    torch.save's zip writer turns a failed write into a RuntimeError: then a small probe write
    into `folder` names the storage's own error (no space, permission, I/O)."""
    errors = [exc]
    for wrapped in getattr(exc, "failures", {}).values():
        errors.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
    os_error = next((e for e in errors if isinstance(e, OSError)), None)
    if os_error is not None:
        return str(os_error)
    inner = errors[1] if len(errors) > 1 else exc
    what = f"{type(inner).__name__}: {str(inner).strip()}".splitlines()[0]
    if storage.is_url(folder):  # the store's client named its error already
        return what
    # One probe per process: the ranks of a job probe the same shared folder at once.
    probe = os.path.join(folder, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * (1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        return f"{e} ({what})"
    finally:
        try:
            os.remove(probe)
        except FileNotFoundError:  # never created (the open failed)
            pass
    return what


# ------------------------------------------------------------------------------------- load
def saved_fingerprint(folder: str) -> str | None:
    """The model fingerprint a verified checkpoint's manifest records (None: no manifest)."""
    try:
        with storage.open_file(storage.join(folder, MANIFEST), "r") as fh:
            return json.load(fh).get("model_fingerprint")
    except FileNotFoundError:
        return None


def check_share(
    folder: str, step: int, verify: str, rank: int, world: int, allow_pickle: bool = False
) -> str | None:
    """None if this rank's share of checkpoint `folder` is intact, LEGACY for a checkpoint
    without a manifest that looks whole, else what is wrong (one phrase). A `.metadata` that
    would run code is wrong too, manifest or not: the manifest guards against damage, and
    anyone who can plant a file can re-hash it (trainer/checkpoint/safe_load.py)."""
    manifest_path = storage.join(folder, MANIFEST)
    if not storage.exists(manifest_path):
        return _check_legacy(folder, rank, world, allow_pickle)
    meta = _read_metadata(folder, allow_pickle)
    if isinstance(meta, str):
        return meta
    try:
        with storage.open_file(manifest_path, "r") as fh:
            manifest = json.load(fh)
        files = manifest["files"]
        assert manifest["format"] == FORMAT and isinstance(files, dict)
    except Exception as e:  # noqa: BLE001 - any unreadable manifest is damage
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    if manifest.get("step") != step:
        return f"{MANIFEST} is for step {manifest.get('step')}"
    if verify == "auto":
        total = sum(int(f["bytes"]) for f in files.values())
        verify = "checksums" if total <= AUTO_CHECKSUM_BYTES else "sizes"
    for name in _my_share(list(files), rank, world):
        problem = _check_file(storage.join(folder, name), files[name], verify)
        if problem:
            return problem
    return None


def _check_file(path: str, want: dict, verify: str) -> str | None:
    name = storage.basename(path)
    try:
        size = storage.size(path)
        if size != want["bytes"]:
            return f"{name} has {size} bytes, the manifest says {want['bytes']}"
        kind = CHECKSUM if CHECKSUM in want else "blake2b"
        if verify == "checksums" and file_checksum(path, kind) != want[kind]:
            return f"{name} does not match its checksum"
    except OSError as e:
        return f"{name}: {e.strerror or e}" if e.errno != errno.ENOENT else f"{name} is missing"
    return None


def _read_metadata(folder: str, allow_pickle: bool):
    """The folder's DCP metadata, read without running code, or what is wrong with it."""
    try:
        return safe_load.read_metadata(folder, allow_pickle)
    except safe_load.UntrustedCheckpoint as e:
        return f"untrusted: {e.detail}, which a checkpoint never holds"
    except FileNotFoundError:
        return "missing .metadata"
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file fails in many ways
        return f"unreadable .metadata ({type(e).__name__})"


def _check_legacy(folder: str, rank: int, world: int, allow_pickle: bool) -> str | None:
    """No manifest: damaged if the metadata is unreadable, says a manifest was written, or
    points past the end of a file; else LEGACY."""
    meta = _read_metadata(folder, allow_pickle)
    if isinstance(meta, str):
        return meta
    if any(key.split(".")[0] == MARKER_KEY for key in meta.state_dict_metadata):
        return f"{MANIFEST} is missing"
    extents: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        extents[info.relative_path] = max(end, extents.get(info.relative_path, 0))
    for name in _my_share(list(extents), rank, world):
        try:
            size = storage.size(storage.join(folder, name))
        except OSError:
            return f"{name} is missing"
        if size < extents[name]:
            return f"{name} has {size} bytes, .metadata needs {extents[name]}"
    return LEGACY
