"""Where checkpoints live: a local (or shared) folder, or an object store URL.

`checkpoint.folder` is a folder relative to `job.dump_folder`, or `s3://bucket/prefix` /
`gs://bucket/prefix`. Every file operation of the checkpointer and of the integrity checks
goes through the functions here, which take plain path strings and act on the local file
system or, for a URL, on fsspec's store (s3fs, gcsfs: imported only when a URL is used, from
the `s3` / `gcs` extras). Credentials and endpoints come from the client libraries' standard
places (AWS_* variables and ~/.aws files, AWS_ENDPOINT_URL for S3-compatible stores; Google's
application default credentials); nothing here reads, prints or records them.

An object store has no rename of a folder and no directories: where a local checkpoint is
committed by renaming `step-N.partial` to `step-N`, a URL checkpoint is written in place under
`step-N/` and committed by its manifest, written last by rank 0 (checkpointer.py).
`move_tree` (used only to set an abandoned or superseded step aside) is a server-side copy
then a delete. Listings are never cached: every rank sees what the others wrote.
"""

from __future__ import annotations

import os
import shutil
from typing import IO

from trainer.checkpoint import retry
from trainer.errors import ConfigError

SCHEMES = {"s3": 's3fs (pip install -e ".[s3]")', "gs": 'gcsfs (pip install -e ".[gcs]")'}


def is_url(path) -> bool:
    return "://" in str(path)


def check_path(path: str, key: str) -> None:
    """A URL must be s3:// or gs://; its client library must be installed."""
    if not is_url(path):
        return
    scheme = str(path).split("://", 1)[0]
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{key} = {path!r}: the scheme {scheme}:// is not supported; use a "
            "local folder, s3://bucket/prefix or gs://bucket/prefix"
        )
    if not str(path).split("://", 1)[1].split("/", 1)[0]:
        raise ConfigError(f"{key} = {path!r} names no bucket; use {scheme}://bucket/prefix")
    try:
        filesystem(path)
    except ImportError:
        raise ConfigError(f"{key} = {path!r} needs {SCHEMES[scheme]}") from None


def filesystem(path: str):
    """fsspec's file system for a URL (one instance per scheme and endpoint, listings never
    cached; on s3:// every request under retry.py's retries, counted). The endpoint of the
    moment is part of fsspec's instance key, so a changed AWS_ENDPOINT_URL never reaches a
    client made for the old one."""
    import fsspec

    scheme = str(path).split("://", 1)[0]
    options = {"use_listings_cache": False}
    if scheme == "s3":
        retry.s3_filesystem_class()  # registered as fsspec's "s3" (DCP's reader uses it too)
        if os.environ.get("AWS_ENDPOINT_URL"):
            options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    return fsspec.filesystem(scheme, **options)


def join(root: str, *names: str) -> str:
    return "/".join([str(root).rstrip("/"), *names]) if is_url(root) else os.path.join(root, *names)


def basename(path) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def probe(root: str, key: str) -> None:
    """Reach the bucket of a URL once, so that a missing bucket, a denied request or a bad
    endpoint is one config error before any step (nothing for a local folder)."""
    if not is_url(root):
        return
    bucket = str(root).split("://", 1)[1].split("/", 1)[0]
    fs = filesystem(root)
    try:
        fs.ls(f"{str(root).split('://', 1)[0]}://{bucket}", detail=False)
    except FileNotFoundError:
        raise ConfigError(
            f"{key} = {root!r}: the bucket {bucket!r} does not exist (or is not "
            "visible to these credentials); create it or name another"
        ) from None
    except PermissionError as e:
        raise ConfigError(
            f"{key} = {root!r}: access denied ({_first_line(e)}); check the "
            "credentials (AWS_* variables, ~/.aws, or Google's default "
            "credentials)"
        ) from None
    except Exception as e:  # noqa: BLE001 - connection refused, DNS, TLS: all 'unreachable'
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "the default endpoint")
        raise ConfigError(
            f"{key} = {root!r}: cannot reach the store at {endpoint} "
            f"({type(e).__name__}: {_first_line(e)})"
        ) from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


# ----------------------------------------------------------------------------- files
def exists(path: str) -> bool:
    return filesystem(path).exists(path) if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return filesystem(path).isdir(path) if is_url(path) else os.path.isdir(path)


def listdir(path: str) -> list[str]:
    """Names under a folder or prefix ([] if there is none)."""
    if not is_url(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs = filesystem(path)
    try:
        return [basename(p) for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def size(path: str) -> int:
    """A file's size; raises FileNotFoundError (an OSError) if it is missing."""
    if not is_url(path):
        return os.path.getsize(path)
    return int(filesystem(path).info(path)["size"])


def open_file(path: str, mode: str = "rb") -> IO:
    return filesystem(path).open(path, mode) if is_url(path) else open(path, mode)


def write_durably(path: str, text: str) -> None:
    """Write a small text file whole: locally a temp file, fsync, rename; on a store one
    PutObject (an object appears whole or not at all)."""
    if is_url(path):
        filesystem(path).pipe_file(path, text.encode())
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def remove_tree(path: str) -> None:
    """Delete a folder or prefix and everything under it; nothing if it is not there."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs = filesystem(path)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def remove_file(path: str) -> None:
    try:
        filesystem(path).rm_file(path) if is_url(path) else os.remove(path)
    except FileNotFoundError:
        pass


def move_tree(src: str, dst: str, first: str | None = None) -> None:
    """Rename a folder (locally atomic; on a store a server-side copy, then a delete of the
    original, its file named `first` before the others)."""
    if not is_url(src):
        os.replace(src, dst)
        return
    fs = filesystem(src)
    fs.copy(src.rstrip("/") + "/", dst.rstrip("/") + "/", recursive=True)
    if first is not None:
        remove_file(join(src, first))
    fs.rm(src, recursive=True)


def store_errors() -> tuple[type[BaseException], ...]:
    """The errors a storage operation may raise: OSError (s3fs maps most S3 errors to it) and
    botocore's own (a connection closed or reset past the retries, a client error s3fs does
    not map), when botocore is installed."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return (OSError,)
    return (OSError, BotoCoreError, ClientError)


def abort_uploads(root: str) -> int:
    """Abort the unfinished multipart uploads under an s3:// prefix (left by a process killed
    mid-upload: invisible, billed, never completed); how many. Call only while holding the
    folder's lease: every upload there is then a dead run's."""
    if not str(root).startswith("s3://"):
        return 0
    bucket, _, prefix = str(root)[len("s3://") :].partition("/")
    client = retry.boto3_client()
    aborted = 0
    for page in client.get_paginator("list_multipart_uploads").paginate(
        Bucket=bucket, Prefix=prefix.rstrip("/") + "/" if prefix else ""
    ):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
            aborted += 1
    return aborted


def upload_folder(local: str, url: str) -> list[str]:
    """Copy the files of a local folder (not its subfolders) to `url/<name>` (large files in
    parts: s3fs uploads multipart beyond its block size); the names, sorted."""
    fs = filesystem(url)
    names = sorted(n for n in os.listdir(local) if os.path.isfile(os.path.join(local, n)))
    for name in names:
        fs.put_file(os.path.join(local, name), join(url, name))
    return names


# ----------------------------------------------------------------------------- DCP
def dcp_writer(path: str, filesystem_class, threads: int = 1):
    """DCP's writer for `path` with `filesystem_class` (a hashing subclass of DCP's local or
    fsspec file system) as its storage. On a store: no fsync (a closed object is durable),
    each rank's share split into `threads` files written at once (DCP's thread_count: s3fs
    sends one file's parts one after another), each a multipart upload beyond s3fs's block."""
    import torch.distributed.checkpoint as dcp

    if not is_url(path):
        writer = dcp.FileSystemWriter(path)
        writer.fs = filesystem_class()
        return writer
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer = FsspecWriter(
        path, sync_files=False, use_listings_cache=False, thread_count=max(1, int(threads))
    )
    writer.fs = filesystem_class()
    writer.fs.fs = filesystem(path)
    return writer


def fsspec_base():
    """DCP's fsspec file system class (imported only for a URL)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    return FileSystem
