"""Loading a checkpoint without running code from it.

DCP's own reader unpickles `.metadata` with `pickle.load` and its byte entries with
`torch.load(weights_only=False)`: a doctored checkpoint folder runs its payload on every rank
that reads it. Here `.metadata` goes through an unpickler that admits only the classes DCP's
metadata is made of, and byte entries load with `weights_only=True`; anything else is refused
with one line naming the class (`UntrustedCheckpoint`). Tensors are read by DCP with
`weights_only=True` already.

`checkpoint.allow_pickle = true` (`--allow-pickle` for `trainer.convert` and
`trainer.generate`) opts out, for checkpoints of torch versions whose metadata holds classes
this list lacks. Only for checkpoints you wrote yourself: a pickle can run any code.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from trainer.checkpoint import storage
from trainer.errors import CheckpointError

OPT_OUT = "checkpoint.allow_pickle"
# What DCP's metadata is made of (torch 2.11-2.13): dataclasses, an enum, paths, sizes, dtypes.
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"StreamTransformExtension"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


class UntrustedCheckpoint(CheckpointError):
    """A checkpoint whose metadata or byte entries would run code (or name classes DCP's
    metadata never holds)."""


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (not damage)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def untrusted(path: str, what: str, detail: str) -> UntrustedCheckpoint:
    err = UntrustedCheckpoint(
        f"{path}: {what} names {detail}, which a DCP checkpoint never holds; it was not loaded "
        f"(loading it could run code). If you wrote this checkpoint yourself with another torch "
        f"version, set {OPT_OUT} = true (--allow-pickle for convert and generate)"
    )
    err.detail = f"{what} names {detail}"
    return err


class _SafeMetadata:
    """`.metadata` read through the allow-list (mixed into DCP's local or fsspec reader)."""

    allow_pickle = False

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.allow_pickle:
            return super().read_metadata(*args, **kwargs)
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            try:
                metadata = _MetadataUnpickler(fh).load()
            except _Refused as e:
                raise untrusted(str(self.path), ".metadata", str(e)) from None
        if not isinstance(metadata, Metadata):
            raise untrusted(str(self.path), ".metadata", type(metadata).__name__)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with byte entries (Python values: param groups, states saved as
    bytes) read by torch's weights-only unpickler."""

    def __init__(self, *args, allow_pickle: bool = False, path: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_pickle, self.path = allow_pickle, path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        if self.allow_pickle:
            return super().load_bytes(read_item, value)
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise untrusted(
                self.path, f"the entry {read_item.dest_index.fqn}", str(e).splitlines()[0][:200]
            ) from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeReader(_SafeMetadata, dcp.FileSystemReader):
    """DCP's file system reader with `.metadata` read through the allow-list."""

    def __init__(self, path, allow_pickle: bool = False):
        super().__init__(path)
        self.allow_pickle = allow_pickle


class _FilesAtOnce:
    """A DCP reader that reads up to `threads` of the plan's files at once, one stream each
    (DCP reads them one after another): on an object store each file is a stream of ranged
    GETs, and a rank's share of a step is several files (checkpoint.store_threads)."""

    threads = 1

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            by_file.setdefault(name, []).append(item)
        if self.threads <= 1 or len(by_file) <= 1:
            return super().read_data(plan, planner)

        def read(items) -> None:
            super(_FilesAtOnce, self).read_data(
                dataclasses.replace(plan, items=items), planner
            ).wait()

        with ThreadPoolExecutor(min(self.threads, len(by_file)), "dcp-read") as pool:
            for done in [pool.submit(read, items) for items in by_file.values()]:
                done.result()  # the first error, raised here
        finished: Future = Future()
        finished.set_result(None)
        return finished


def reader(path: str, allow_pickle: bool = False, threads: int = 8):
    """A SafeReader for a folder, or its fsspec twin for an s3:// or gs:// URL, which reads
    `threads` files at once."""
    if not storage.is_url(path):
        return SafeReader(path, allow_pickle)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    safe = type("SafeFsspecReader", (_SafeMetadata, _FilesAtOnce, FsspecReader), {})(
        path, use_listings_cache=False
    )
    safe.allow_pickle, safe.threads = allow_pickle, int(threads)
    return safe


def read_metadata(path: str, allow_pickle: bool = False) -> Metadata:
    return reader(path, allow_pickle).read_metadata()


def load(
    state_dict: dict,
    path: str,
    *,
    allow_pickle: bool = False,
    partial: bool = False,
    no_dist: bool = False,
    threads: int = 8,
) -> None:
    """`dcp.load` of `state_dict` from checkpoint folder `path`, without running its code.
    `partial`: keys missing from the checkpoint keep their current values; `threads`: files
    read at once from an object store."""
    path = os.fspath(path)
    # First on its own: dcp.load swallows a reader's error (it falls back to per-rank
    # metadata files) and would bury the refusal in its own.
    read_metadata(path, allow_pickle)
    dcp.load(
        state_dict,
        storage_reader=reader(path, allow_pickle, threads),
        planner=SafeLoadPlanner(allow_partial_load=partial, allow_pickle=allow_pickle, path=path),
        no_dist=no_dist,
    )


def load_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint folder `path` (a local folder or a store URL), whole, on
    this one process without a process group: for reading a checkpoint offline (a comparison,
    an export script, the tests)."""
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.fspath(path)
    if storage.is_url(path):
        storage.filesystem(path)  # the store's client with its retries
    meta = read_metadata(path)
    tensors = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        load(tensors, path, no_dist=True)
    return tensors
