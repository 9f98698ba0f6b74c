"""An exclusive file lock that says when it waits (stores and caches built by one process
while the others wait: the ranks of a job, or two prepare commands on one path)."""

from __future__ import annotations

import contextlib
import fcntl
import sys
from pathlib import Path

from trainer.errors import DataError


@contextlib.contextmanager
def file_lock(path: Path, waiting_message: str):
    """Exclusive flock on `path`, saying so when another process holds it."""
    try:
        f = open(path, "a+")
    except OSError as e:
        raise DataError(f"cannot create lock file {path} (data.cache_dir): {e.strerror}") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(waiting_message, file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
