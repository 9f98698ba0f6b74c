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
A lease deleted meanwhile (a refresh's If-Match answers 404) is created again. Staleness is
judged by the store's clock (the lease's LastModified against the answer's Date), never the
holder's. At start the store must refuse a second `If-None-Match: *` write: a store that
ignores conditions (GCS's S3 API, older MinIO) cannot keep a second run out, and the run
refuses unless `checkpoint.store_lease = "unchecked"`. A heartbeat that cannot reach the store
for longer than the lease timeout makes `lost` true (another run may have taken the lease
meanwhile): the loop stops at the next step end rather than go on without knowing; any error
of the heartbeat thread itself stops it the same way, never silently.
gs:// has no such lease yet (the run says so in one line); its folder is guarded only by
the dump folder's lease.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict

from trainer.checkpoint import lease as local_lease
from trainer.checkpoint import retry, storage
from trainer.checkpoint.lease import Holder, LeaseHeld, why_free
from trainer.errors import ConfigError

LEASE_FILE = "lease.json"
_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
_MISSING = ("NoSuchKey", "404", "NotFound")


def _code(e: Exception) -> str | None:
    """The S3 error code of a botocore error; None for one without an answer (a reset, a
    timeout: their `response` is None or absent)."""
    response = getattr(e, "response", None) or {}
    return (response.get("Error") or {}).get("Code")


def _conflict(e: Exception) -> bool:
    return _code(e) in _CONFLICT


def _missing(e: Exception) -> bool:
    return _code(e) in _MISSING


def _store_age(got: dict) -> float | None:
    """Seconds since the object was last written, by the store's clock (its answer's Date
    header against the object's LastModified); None if the answer lacks either."""
    from email.utils import parsedate_to_datetime

    date = (got.get("ResponseMetadata", {}).get("HTTPHeaders") or {}).get("date")
    modified = got.get("LastModified")
    if not date or modified is None:
        return None
    try:
        return max(0.0, (parsedate_to_datetime(date) - modified).total_seconds())
    except (TypeError, ValueError):
        return None


class UnconditionalStore(ConfigError):
    """The store accepted a write that its condition should have refused."""


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
        self._lost_to: str | None = None  # set once: another run holds it, or the beat died
        self._last_ok = time.monotonic()  # the last time the store confirmed the lease ours
        self._failing = False  # the store is not answering the refreshes (said once)

    # -------------------------------------------------------------------------- lost
    @property
    def lost(self) -> bool:
        return self.lost_to is not None

    @property
    def lost_to(self) -> str | None:
        """Why this run no longer knows the lease is its own (None while it does)."""
        if self._lost_to is not None:
            return self._lost_to
        silent = time.monotonic() - self._last_ok
        if self._thread is not None and silent > self.timeout:
            return (
                f"{self.url} (its heartbeat has not reached the store for {silent:.0f}s, "
                f"past job.lease_timeout_seconds = {self.timeout:g}: another run may hold "
                "it now)"
            )
        return None

    def _lose(self, why: str, line: str) -> None:
        self._lost_to = f"{self.url} ({why})"
        self.log(line)

    # -------------------------------------------------------------------------- requests
    def _put(self, **condition) -> str:
        body = json.dumps(asdict(self.me), indent=1).encode()
        return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, **condition)[
            "ETag"
        ]

    def _read(self) -> tuple[Holder | str | None, str | None, float | None]:
        """(holder, ETag, age by the store's clock); (None, None, None) if there is none."""
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None, None, None
        age = _store_age(got)
        try:
            return Holder(**json.loads(got["Body"].read())), got["ETag"], age
        except (ValueError, TypeError):
            return "unreadable", got["ETag"], age

    # -------------------------------------------------------------------------- taking it
    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeld naming the live holder."""
        for _ in range(50):
            try:
                self.etag = self._put(IfNoneMatch="*")
                self._last_ok = time.monotonic()
                return
            except Exception as e:  # noqa: BLE001 - botocore's ClientError, by its code
                if not _conflict(e):
                    raise
            holder, etag, age = self._read()
            if holder is None:
                continue  # released meanwhile
            reason = (
                "unreadable"
                if holder == "unreadable"
                else why_free(
                    holder,
                    self.timeout,
                    self.me.job,
                    time.time() if age is None else holder.heartbeat + age,
                )
            )
            if reason is None:
                raise LeaseHeld(
                    f"checkpoint.folder {self.url} is in use by another run: "
                    f"{holder.describe()}; give this run another checkpoint.folder, or stop that "
                    f"one (a lease whose heartbeat stops for job.lease_timeout_seconds = "
                    f"{self.timeout:g} is taken over; {self.url}/{LEASE_FILE})"
                )
            try:
                self.etag = self._put(IfMatch=etag)
            except Exception as e:  # noqa: BLE001
                if not _conflict(e):
                    raise
                continue  # changed since it was judged: judge again
            self._last_ok = time.monotonic()
            if holder == "unreadable" or holder.job != self.me.job:
                self.log(
                    f"checkpoint folder {self.url}: taking over the lease of "
                    f"{holder if holder == 'unreadable' else holder.describe()} ({reason})"
                )
            return
        raise LeaseHeld(
            f"checkpoint.folder {self.url}: could not take {LEASE_FILE} (other runs keep taking it)"
        )

    def check_conditions(self) -> bool:
        """Whether the store refuses a write whose condition fails: a probe object next to the
        lease is created with `If-None-Match: *` twice (the second must be refused), then
        deleted. Run before `acquire`: on a store that ignores conditions the probe, not
        another run's lease, is what gets written over."""
        key = f"{self.key}.probe-{self.me.token}"
        put = dict(Bucket=self.bucket, Key=key, Body=b"{}", IfNoneMatch="*")
        self.client.put_object(**put)
        try:
            self.client.put_object(**put)
        except Exception as e:  # noqa: BLE001 - botocore's ClientError, by its code
            if _conflict(e):
                return True
            if _code(e) in ("NotImplemented", "501"):
                return False
            raise
        finally:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        return False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="store-lease", daemon=True)
        self._thread.start()
        local_lease.hold(self)

    def _beat(self) -> None:
        try:
            while not self._stop.wait(max(0.5, self.timeout / 6)):
                if not self.refresh():
                    return
        except BaseException as e:  # noqa: BLE001 - a dead heartbeat must stop the run
            self._lose(
                f"its heartbeat failed: {type(e).__name__}: {e}",
                f"warning: the lease heartbeat on {self.url} failed ({type(e).__name__}: "
                f"{e}); this run stops at the next step end",
            )

    def refresh(self) -> bool:
        """One heartbeat; False once another run holds the lease."""
        self.me.heartbeat = time.time()
        try:
            self.etag = self._put(IfMatch=self.etag)
        except storage.store_errors() as e:  # a lost lease, or the store unreachable
            return self._refused(e)
        self._confirmed()
        return True

    def _confirmed(self) -> None:
        if self._failing:
            self.log(f"the lease heartbeat on {self.url} reaches the store again")
        self._failing = False
        self._last_ok = time.monotonic()

    def _refused(self, e: Exception) -> bool:
        """A refresh the store refused or did not answer: judged; False once lost."""
        if _missing(e):  # deleted meanwhile: ours again, unless another run created it
            try:
                self.etag = self._put(IfNoneMatch="*")
                self.log(f"warning: {self.url}/{LEASE_FILE} had been deleted; created again")
                self._confirmed()
                return True
            except storage.store_errors() as again:
                if not _conflict(again):
                    return self._unanswered(again)
        elif not _conflict(e):
            return self._unanswered(e)
        if self._still_ours():
            self._confirmed()
            return True
        self._lose(
            "another run took it over",
            f"warning: this run lost the lease on {self.url} (another run took it over); "
            "another run may be writing there",
        )
        return False

    def _unanswered(self, e: Exception) -> bool:
        if not self._failing:
            self.log(
                f"warning: could not refresh {self.url}/{LEASE_FILE} "
                f"({type(e).__name__}: {e}); trying again"
            )
        self._failing = True
        return True

    def _still_ours(self) -> bool:
        """After a refused refresh: whether the lease still holds our token (a retried PUT
        whose first try landed, its answer lost, is refused against the ETag it replaced):
        then its current ETag is ours to refresh against. Unreachable now: judged again at
        the next beat (the lease is kept, and `lost` turns true past the timeout)."""
        try:
            holder, etag, _ = self._read()
        except storage.store_errors():
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


def take(
    url: str, timeout: float, rank: int, log=print, *, checked: bool = True
) -> StoreLease | None:
    """Rank 0 takes and holds the lease of an s3:// folder (others, and gs://, get None).
    `checked`: refuse a store that ignores conditional writes (checkpoint.store_lease)."""
    if rank != 0:
        return None
    if not url.startswith("s3://"):
        log(
            f"note: {url} has no lease of its own (conditional writes are used on s3:// only); "
            "only the dump folder's lease keeps a second run out"
        )
        return None
    held = StoreLease(url, timeout, log=log)
    if not held.check_conditions():
        if checked:
            raise UnconditionalStore(
                f"checkpoint.folder {url}: this store ignores conditional writes (If-None-Match), "
                "so no lease can keep a second run out of the folder; use a store that honours "
                'them (AWS S3, MinIO 2025+, ...), or set checkpoint.store_lease = "unchecked" '
                "to run without that guard"
            )
        log(
            f"warning: {url}: the store ignores conditional writes; running without a lease "
            'that keeps other runs out (checkpoint.store_lease = "unchecked")'
        )
    held.acquire()
    held.start()
    return held
