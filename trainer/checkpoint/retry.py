"""Retries of object-store requests (s3://): bounded attempts, exponential backoff with full
jitter, and a count of every retry that reaches the metrics.

Object stores answer a busy moment with 503 SlowDown, sometimes a 500, a response that never
comes (a read timeout) or a reset connection; all four are transient and a request that meets
one is sent again. Every request of this process to S3 goes through botocore (s3fs's
aiobotocore client for checkpoints, token stores and Hugging Face folders; boto3 for the
checkpoint folder's lease), and each of those clients asks its `needs-retry` event whether to
send a failed attempt again. `hook(events)` puts this module's policy in botocore's own place:
the client is made with one attempt of botocore's retries, its retry handler is unregistered
and `_needs_retry` below answers instead. It is the only retry layer: s3fs's own re-calls are
set to one attempt (`S3FileSystem.retries = 1`), so `checkpoint.store_retries` bounds what one
request may cost and the counts are exactly the attempts sent again, never an estimate.

The policy (`checkpoint.store_retries`, `checkpoint.store_timeout_seconds`, set in every
process by `configure` before the first request):
- retried: HTTP 429 and 5xx answers (throttled: 503 SlowDown, 429, codes SlowDown /
  Throttling*), 408 and 400 RequestTimeout (timeouts), 400 BadDigest /
  XAmzContentSHA256Mismatch / IncompleteBody (a body damaged on the way: counted with the
  server errors), read and connect timeouts, and connections closed or reset before the
  answer or while the body was sent;
- not retried: other 4xx answers (a missing object, a denied request, a failed condition) and
  a refused connection (a wrong endpoint is one config line at once, not a minute of backoff);
- retry k waits uniform(0, min(20 s, 0.2 s x 2^(k-1))) first ("full jitter", as AWS advises:
  ranks that meet the same throttling do not come back in step; 5 retries wait ~3 s on
  average, at most 6.2 s).

A CompleteMultipartUpload whose retry is answered NoSuchUpload (MinIO's answer when the first
attempt completed the object and its answer was lost; AWS answers 200) is taken as done when
the object's ETag is the one its parts make (`completed_already`), never on the name alone.

Counts (per process, since it started): `counts()`; the loop logs their sum over the ranks
as `store/*` scalars (`metrics`). gs:// uses gcsfs's own retries, not counted here.
"""

from __future__ import annotations

import functools
import hashlib
import random
import threading

MAX_SLEEP = 20.0  # seconds: the backoff's cap
BACKOFF = 0.2  # seconds: the first retry's longest wait, doubled at each retry
THROTTLE_CODES = (
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestThrottled",
)
# 400s that S3 documents as the request's own bad luck, not the client's fault: the
# connection idled past the server's wait, and a body damaged on the way (its checksum)
TIMEOUT_CODES = ("RequestTimeout", "RequestTimeoutException")
CORRUPTED_CODES = ("BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest", "IncompleteBody")
KINDS = ("throttled", "server_errors", "timeouts", "resets")  # what a retry was for

_settings = {"retries": 5, "timeout": 60.0}
_counts = dict.fromkeys(("retries", *KINDS, "gave_up"), 0)
_lock = threading.Lock()
_rng = random.Random()
_active = False  # the run names a URL (the same on every rank: from its config)


def configure(cfg) -> None:
    """Take the retry settings of a JobConfig (its [checkpoint] section's store_* keys)."""
    global _active
    c = cfg.checkpoint
    _settings.update(retries=int(c.store_retries), timeout=float(c.store_timeout_seconds))
    data = cfg.data
    urls = [
        c.folder if c.enable else "",
        c.initial_load_path,
        data.store_path,
        *(getattr(m, "store_path", "") for m in (data.mix or [])),
    ]
    _active = any("://" in str(u) for u in urls)


def settings() -> dict:
    return dict(_settings)


def counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def _count(kind: str | None) -> None:
    with _lock:
        if kind is None:
            _counts["gave_up"] += 1
        else:
            _counts["retries"] += 1
            _counts[kind] += 1


def classify(response, caught_exception) -> str | None:
    """Which transient fault an attempt met (KINDS), or None: not to be retried."""
    if caught_exception is not None:
        return _classify_error(caught_exception)
    if not response:
        return None
    http, parsed = response
    status = getattr(http, "status_code", 200)
    code = (parsed or {}).get("Error", {}).get("Code", "")
    if status == 429 or code in THROTTLE_CODES or (status == 503 and code in ("", "503")):
        return "throttled"
    if status == 408 or code in TIMEOUT_CODES:
        return "timeouts"
    if code in CORRUPTED_CODES or status >= 500:
        return "server_errors"
    return None


def _classify_error(e: BaseException) -> str | None:
    from botocore.exceptions import (
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        HTTPClientError,
        ReadTimeoutError,
    )

    if isinstance(e, (ReadTimeoutError, ConnectTimeoutError)):
        return "timeouts"
    if isinstance(e, EndpointConnectionError):
        # refused, no route, bad name: the endpoint is wrong, not busy; but aiohttp reports a
        # connection reset while the body was being sent under this name too
        return "resets" if _reset_while_sending(e) else None
    if isinstance(e, (ConnectionClosedError, HTTPClientError, ConnectionError)):
        return "resets"
    return None


def _reset_while_sending(e: BaseException) -> bool:
    """An EndpointConnectionError whose cause is a connection that was open and then lost
    (aiohttp's ClientOSError writing the body, a reset or broken pipe), not one never made."""
    import errno
    import socket

    cause = (getattr(e, "kwargs", None) or {}).get("error") or e.__context__
    try:
        from aiohttp import ClientConnectorError
    except ImportError:  # pragma: no cover - s3fs brings aiohttp
        ClientConnectorError = ()  # noqa: N806
    if cause is None or isinstance(
        cause, (ClientConnectorError, ConnectionRefusedError, socket.gaierror)
    ):
        return False
    # aiohttp 3.14 reports a broken pipe while writing the body as a ClientOSError (an
    # OSError with errno EPIPE, not a BrokenPipeError), earlier ones with "write request body"
    lost = (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED)
    return (
        isinstance(cause, (ConnectionResetError, BrokenPipeError))
        or getattr(cause, "errno", None) in lost
        or "write request body" in str(cause)
    )


def backoff(attempt: int) -> float:
    """Seconds to wait before attempt `attempt` + 1 (full jitter, capped)."""
    return _rng.uniform(0.0, min(MAX_SLEEP, BACKOFF * 2 ** (attempt - 1)))


def _needs_retry(response=None, attempts=1, caught_exception=None, **_) -> float | None:
    """botocore's needs-retry event: the seconds to wait before sending again, or None."""
    kind = classify(response, caught_exception)
    if kind is None:
        return None
    if attempts > _settings["retries"]:
        _count(None)  # a transient fault outlasted every retry: the caller sees the error
        return None
    _count(kind)
    return backoff(attempts)


def hook(events) -> None:
    """Make this module the retry policy of a botocore client (its `meta.events`)."""
    events.unregister("needs-retry.s3", unique_id="retry-config-s3")
    events.register("needs-retry.s3", _needs_retry, unique_id="trainer-store-retry")


def client_config() -> dict:
    """botocore Config arguments: one attempt of botocore's own policy, this run's timeouts."""
    t = _settings["timeout"]
    return {
        "retries": {"mode": "standard", "total_max_attempts": 1},
        "read_timeout": t,
        "connect_timeout": min(t, 10.0),
    }


def boto3_client():
    """A boto3 S3 client (endpoint and credentials from the standard places) under this
    policy: the checkpoint folder's lease (store_lease.py)."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", config=Config(**client_config()))
    hook(client.meta.events)
    return client


_s3_class = None


def s3_filesystem_class():
    """s3fs's S3FileSystem with this policy on every client it makes; registered as fsspec's
    "s3" so that DCP's fsspec reader and writer use it too."""
    global _s3_class
    if _s3_class is not None:
        return _s3_class
    import fsspec
    from s3fs import S3FileSystem

    class RetryingS3FileSystem(S3FileSystem):
        retries = 1  # s3fs's own layer: off (one attempt); botocore's event decides

        def _prepare_config_kwargs(self):
            return {
                **super()._prepare_config_kwargs(),
                **client_config(),
                "http_session_cls": _aiohttp_session_class(),
            }

        async def set_session(self, refresh=False, kwargs={}):  # noqa: B006 - s3fs's signature
            s3 = await super().set_session(refresh, kwargs)
            if not getattr(s3, "_trainer_retry", False):
                hook(s3.meta.events)
                s3._trainer_retry = True
            return s3

        async def _call_s3(self, method, *akwarglist, **kwargs):
            try:
                return await super()._call_s3(method, *akwarglist, **kwargs)
            except FileNotFoundError:
                if method != "complete_multipart_upload":
                    raise
                done = await completed_already(self, kwargs)
                if done is None:
                    raise
                return done

    fsspec.register_implementation("s3", RetryingS3FileSystem, clobber=True)
    _s3_class = RetryingS3FileSystem
    return _s3_class


def multipart_etag(parts: list[dict]) -> str:
    """The ETag S3 gives an object completed from `parts` (CompleteMultipartUpload's list):
    the MD5 of the parts' binary MD5s, then "-<number of parts>"."""
    digests = b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts)
    return f'"{hashlib.md5(digests).hexdigest()}-{len(parts)}"'


async def completed_already(fs, kwargs: dict) -> dict | None:
    """A CompleteMultipartUpload answered NoSuchUpload: on some stores (MinIO) the answer to a
    retry whose first attempt completed the object, its answer lost. The object is whole if its
    ETag is the one those parts make: then that is the answer (else None: the error stands)."""
    try:
        head = await fs._call_s3("head_object", Bucket=kwargs["Bucket"], Key=kwargs["Key"])
        expected = multipart_etag(kwargs["MultipartUpload"]["Parts"])
    except (FileNotFoundError, KeyError, ValueError):
        return None
    if head.get("ETag") != expected:
        return None
    return {"Bucket": kwargs["Bucket"], "Key": kwargs["Key"], "ETag": head["ETag"]}


@functools.lru_cache(maxsize=None)
def _aiohttp_session_class():
    """aiobotocore's HTTP session without aiohttp's own silent resend of a request whose
    connection was reset (once, for GET/PUT/HEAD/DELETE): left on, a reset would be retried
    uncounted and outside the bound; this module's policy retries it instead."""
    from aiobotocore.httpsession import AIOHTTPSession

    class OneAttemptSession(AIOHTTPSession):
        async def _get_session(self, proxy_url):
            session = await super()._get_session(proxy_url)
            if hasattr(session, "_retry_connection"):  # aiohttp >= 3.10 (private)
                session._retry_connection = False
            return session

    return OneAttemptSession


def metrics(all_ranks_sum=None) -> dict[str, float]:
    """The `store/*` scalars of a run that uses a URL ({} otherwise): retries in all, by fault,
    and requests that failed after every retry. `all_ranks_sum(list) -> list` sums over the
    ranks (a collective: called on every rank; whether it is called depends only on the
    config, the same everywhere)."""
    if not _active:
        return {}
    names = ("retries", *KINDS, "gave_up")
    mine = counts()
    values = [float(mine[n]) for n in names]
    if all_ranks_sum is not None:
        values = all_ranks_sum(values)
    return {f"store/{n}": float(v) for n, v in zip(names, values, strict=True)}


def request_budget(retries: int, timeout: float) -> float:
    """The longest one request may take through every retry: each attempt up to the timeout,
    each backoff up to its cap."""
    r, t = int(retries), float(timeout)
    return (r + 1) * t + sum(min(MAX_SLEEP, BACKOFF * 2 ** (k - 1)) for k in range(1, r + 1))
