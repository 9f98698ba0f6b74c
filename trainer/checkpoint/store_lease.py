"""One run per checkpoint folder on S3: `{checkpoint.folder}/lease.json`, by conditional writes.

The dump folder stays local and keeps its own lease (lease.py); two runs with different dump
folders could still name the same `s3://` checkpoint folder, so rank 0 also leases that one,
with the same holder record, rules and messages, through S3's conditional requests (boto3:
s3fs does not pass them):
- taking: PutObject with `If-None-Match: *` (fails if any lease exists);
- a takeover of a stale lease: PutObject with `If-Match: <the stale lease's ETag>` (fails if
  anyone changed it since it was judged stale: no read-then-write race, and no claim file);
- a refresh: PutObject `If-Match: <our last ETag>` (a failure: another run took it over);
- a release: DeleteObject `If-Match: <our last ETag>`.
gs:// has no such lease yet (the run says so in one line); its folder is guarded only by
the dump folder's lease.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict

from trainer.checkpoint import lease as local_lease
from trainer.checkpoint import retry
from trainer.checkpoint.lease import Holder, LeaseHeld, why_free

LEASE_FILE = "lease.json"
_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")


def _conflict(e: Exception) -> bool:
    return getattr(e, "response", {}).get("Error", {}).get("Code") in _CONFLICT


class StoreLease:
    """Rank 0's lease on an s3:// checkpoint folder (see the module docstring)."""

    def __init__(self, url: str, timeout: float, log=print):

        self.url, self.timeout, self.log = url.rstrip("/"), float(timeout), log
        bucket_and_prefix = self.url.split("://", 1)[1]
        self.bucket, _, prefix = bucket_and_prefix.partition("/")
        self.key = f"{prefix}/{LEASE_FILE}" if prefix else LEASE_FILE
        # endpoint and credentials: AWS_ENDPOINT_URL, AWS_* variables, ~/.aws; the run's
        # retries of throttling, 5xx, timeouts and resets, counted (retry.py)
        self.client = retry.boto3_client()
        self.me = local_lease.new_holder()  # the same record as the dump folder's lease
        self.etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, **condition) -> str:
        body = json.dumps(asdict(self.me), indent=1).encode()
        return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                      **condition)["ETag"]

    def _read(self) -> tuple[Holder | str | None, str | None]:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None, None
        try:
            return Holder(**json.loads(got["Body"].read())), got["ETag"]
        except (ValueError, TypeError):
            return "unreadable", got["ETag"]

    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeld naming the live holder."""
        for _ in range(50):
            try:
                self.etag = self._put(IfNoneMatch="*")
                return
            except Exception as e:  # noqa: BLE001 - botocore's ClientError, by its code
                if not _conflict(e):
                    raise
            holder, etag = self._read()
            if holder is None:
                continue  # released meanwhile
            reason = "unreadable" if holder == "unreadable" else why_free(
                holder, self.timeout, self.me.job, time.time())
            if reason is None:
                raise LeaseHeld(
                    f"checkpoint.folder {self.url} is in use by another run: "
                    f"{holder.describe()}; give this run another checkpoint.folder, or stop that "
                    f"one (a lease whose heartbeat stops for job.lease_timeout_seconds = "
                    f"{self.timeout:g} is taken over; {self.url}/{LEASE_FILE})")
            try:
                self.etag = self._put(IfMatch=etag)
            except Exception as e:  # noqa: BLE001
                if not _conflict(e):
                    raise
                continue  # changed since it was judged: judge again
            if holder == "unreadable" or holder.job != self.me.job:
                self.log(f"checkpoint folder {self.url}: taking over the lease of "
                         f"{holder if holder == 'unreadable' else holder.describe()} ({reason})")
            return
        raise LeaseHeld(f"checkpoint.folder {self.url}: could not take {LEASE_FILE} (other runs "
                        "keep taking it)")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="store-lease", daemon=True)
        self._thread.start()
        local_lease.hold(self)

    def _beat(self) -> None:
        while not self._stop.wait(max(0.5, self.timeout / 6)):
            if not self.refresh():
                return

    def refresh(self) -> bool:
        """One heartbeat; False once another run holds the lease."""
        self.me.heartbeat = time.time()
        try:
            self.etag = self._put(IfMatch=self.etag)
        except Exception as e:  # noqa: BLE001 - a lost lease, or the store unreachable
            if not _conflict(e):
                self.log(f"warning: could not refresh {self.url}/{LEASE_FILE}: {e}")
            elif not self._still_ours():
                self.lost_to = f"{self.url} (another run took it over)"
                self.lost = True  # after lost_to: the loop reads both (lease.lost)
                self.log(f"warning: this run lost the lease on {self.url} (another run took "
                         "it over); another run may be writing there")
                return False
        return True

    def _still_ours(self) -> bool:
        """After a refused refresh: whether the lease still holds our token (a retried PUT
        whose first try landed, its answer lost, is refused against the ETag it replaced):
        then its current ETag is ours to refresh against."""
        try:
            holder, etag = self._read()
        except Exception:  # noqa: BLE001 - unreachable now: judged again at the next beat
            return True
        if isinstance(holder, Holder) and holder.token == self.me.token:
            self.etag = etag
            return True
        return False

    def release(self) -> None:
        """Stop refreshing and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)
        except Exception:  # noqa: BLE001, S110 - not ours any more, or gone: nothing to do
            pass


def take(url: str, timeout: float, rank: int, log=print) -> StoreLease | None:
    """Rank 0 takes and holds the lease of an s3:// folder (others, and gs://, get None)."""
    if rank != 0:
        return None
    if not url.startswith("s3://"):
        log(f"note: {url} has no lease of its own (conditional writes are used on s3:// only); "
            "only the dump folder's lease keeps a second run out")
        return None
    held = StoreLease(url, timeout, log=log)
    held.acquire()
    held.start()
    return held
