"""Nothing lost on an object store: moto's S3 server (tests/s3_server.py) behind the fault proxy
(scripts/s3_fault_proxy.py).

- A clean-up that fails after the commit (503 on every bulk delete, keep_latest_k = 1) leaves
  the committed step listed; the run says so in a warning and trains on, and the next launch
  resumes from that step and finishes the clean-up.
- A rewind on a store whose copies are slow (each takes longer than comm.train_timeout_seconds)
  copies no step data and times out no collective: the steps it abandons keep their data under
  a renamed manifest, and its saves commit to fresh prefixes.
- The s3:// lease: a heartbeat that meets 20 s of connection resets survives them when the lease
  timeout is longer (said once, and once that it reaches the store again) and turns `lost` when
  it is shorter; a deleted lease is created again; a heartbeat thread that fails stops the run
  rather than die silently; a store that ignores conditional writes is refused in one line
  unless `checkpoint.store_lease = "unchecked"`.
"""

from __future__ import annotations

import json
import threading
import time
import types

import pytest

from scripts.chaos_common import committed
from scripts.s3_fault_proxy import FaultProxy, Rule
from tests.helpers import BASE_FP32, losses, run_train

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]')")

SAVES = [
    *BASE_FP32,
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
    "--checkpoint.store_timeout_seconds",
    "30",
    "--checkpoint.store_retries",
    "1",
]


@pytest.fixture(scope="module")
def s3():
    from tests.s3_server import s3_server

    with s3_server("safe") as served:
        yield served


@pytest.fixture()
def proxy(s3):
    p = FaultProxy(s3[0]["AWS_ENDPOINT_URL"], delay=12.0).start()
    yield p
    p.stop()


def prefixes(client, run: str) -> dict[str, set[str]]:
    """{prefix under s3://safe/<run>: the names of its objects}."""
    out: dict[str, set[str]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="safe", Prefix=f"{run}/"):
        for obj in page.get("Contents", []):
            folder, _, name = obj["Key"][len(run) + 1 :].partition("/")
            out.setdefault(folder, set()).add(name)
    return out


def test_a_clean_up_that_fails_after_the_commit_keeps_the_committed_step(s3, proxy, tmp_path):
    env, client = s3
    url = "s3://safe/prune"
    via_proxy = {**env, "AWS_ENDPOINT_URL": proxy.url}
    args = [*SAVES, "--checkpoint.folder", url, "--checkpoint.keep_latest_k", "1"]
    deletes = Rule(r"^POST /safe/?\?delete delete=\S*prune/step-2/__0_0\.distcp", ("503",), every=1)
    proxy.set_rules(deletes)
    first = run_train(tmp_path / "run", *args, "--training.steps", "4", nproc=1, env=via_proxy)
    proxy.set_rules()
    assert deletes.fired >= 2  # the old step's bulk delete, through its retry
    assert "warning: cleaning up after checkpoint step-4 failed" in first.stdout
    assert f"the latest checkpoint is {url}/step-4" not in first.stdout  # no failed save
    assert committed(url) == [4]  # step-2's manifest went first: only step-4 is listed
    assert "manifest.json" in prefixes(client, "prune")["step-4"]

    # a rank killed mid-upload: a multipart upload no listing shows (the next launch aborts it)
    client.create_multipart_upload(Bucket="safe", Key="prune/step-6/__0_0.distcp")
    client.create_multipart_upload(Bucket="safe", Key="other/__0_0.distcp")  # not this folder's
    second = run_train(tmp_path / "run", *args, "--training.steps", "6", nproc=1, env=env)
    assert f"resumed from {url}/step-4" in second.stdout, second.stdout
    assert f"aborted 1 unfinished multipart upload(s) under {url}" in second.stdout
    left = client.list_multipart_uploads(Bucket="safe").get("Uploads", [])
    assert [u["Key"] for u in left] == ["other/__0_0.distcp"]
    assert set(losses(tmp_path / "run")) >= {5, 6}
    assert set(prefixes(client, "prune")) == {"step-6"}  # step-2's leftovers cleaned up too


def test_a_rewind_on_a_slow_store_copies_nothing_and_times_out_nothing(s3, proxy, tmp_path):
    """2 ranks, comm.train_timeout_seconds = 10, every server-side copy delayed 12 s: rank 1
    waits for rank 0's (manifest-sized) copies in the checkpoint's own group, whose timeout
    covers the store's requests; no object of a step's data is copied."""
    env, client = s3
    url = "s3://safe/rewind"
    keep = ["--checkpoint.keep_latest_k", "0"]
    run_train(
        tmp_path / "a", *SAVES, *keep, "--checkpoint.folder", url, "--training.steps", "6", env=env
    )
    copies = Rule(r" copy-from=", ("slow",), every=1)
    proxy.set_rules(copies)
    t0 = time.monotonic()
    out = run_train(
        tmp_path / "b",
        *SAVES,
        *keep,
        "--checkpoint.folder",
        url,
        "--checkpoint.load_step",
        "2",
        "--training.steps",
        "4",
        "--comm.train_timeout_seconds",
        "10",
        env={**env, "AWS_ENDPOINT_URL": proxy.url},
    ).stdout
    took = time.monotonic() - t0
    proxy.set_rules()
    copied = [line.split("copy-from=")[1] for line in proxy.log if "copy-from=" in line]
    assert f"resumed from {url}/step-2" in out
    # manifests set aside, and DCP's own rename of each save's .metadata: small objects only
    assert copied and all(c.endswith((".json", ".metadata.tmp")) for c in copied), copied
    assert took > 12 * len(copied)  # the copies were slow, and rank 1 waited for them
    assert committed(url) == [2, 4]
    found = prefixes(client, "rewind")
    assert "manifest.json" in found["step-4.2"]  # the new branch's step-4, a fresh prefix
    for old in ("step-4", "step-6"):  # the abandoned branch's: data in place, not listed
        assert "manifest.json" not in found[old] and "__1_0.distcp" in found[old]
        assert any(n.startswith("manifest.abandoned-") for n in found[old]), found[old]


def lease_client(proxy: FaultProxy):
    """Point this process's store requests at the proxy, with one retry of 3 s each."""
    from trainer.checkpoint import retry

    ck = types.SimpleNamespace(
        store_retries=1, store_timeout_seconds=3.0, enable=False, folder="", initial_load_path=""
    )
    retry.configure(
        types.SimpleNamespace(checkpoint=ck, data=types.SimpleNamespace(store_path="", mix=[]))
    )


def test_a_lease_heartbeat_through_20s_of_resets(s3, proxy, monkeypatch):
    from trainer.checkpoint import lease as local_lease
    from trainer.checkpoint.store_lease import StoreLease

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    lease_client(proxy)
    said: dict[str, list[str]] = {"long": [], "short": []}
    long = StoreLease("s3://safe/lease-long", timeout=40, log=said["long"].append)
    short = StoreLease("s3://safe/lease-short", timeout=8, log=said["short"].append)
    for held in (long, short):
        held.acquire()
        held.start()
    resets = Rule(r"lease\.json", ("reset",), every=1)
    proxy.set_rules(resets)
    time.sleep(20)
    assert short.lost and "has not reached the store for" in short.lost_to
    assert local_lease.lost() is not None  # the loop stops at its next step end
    proxy.set_rules()
    time.sleep(40 / 6 + 4)  # the long lease's next beat, through its retry
    assert resets.fired >= 4 and not long.lost
    warned = [line for line in said["long"] if "could not refresh" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: could not refresh s3://safe/")
    assert said["long"][-1] == "the lease heartbeat on s3://safe/lease-long reaches the store again"
    for held in (long, short):
        local_lease._held["others"].remove(held)
        held.release()


def test_a_deleted_lease_is_created_again_and_a_failing_heartbeat_stops_the_run(s3, proxy):
    from trainer.checkpoint.lease import LeaseHeld
    from trainer.checkpoint.store_lease import StoreLease

    _, client = s3
    said = []
    mine = StoreLease("s3://safe/deleted", timeout=60, log=said.append)
    mine.acquire()
    client.delete_object(Bucket="safe", Key="deleted/lease.json")
    assert mine.refresh() and not mine.lost
    assert said == ["warning: s3://safe/deleted/lease.json had been deleted; created again"]
    held = json.loads(client.get_object(Bucket="safe", Key="deleted/lease.json")["Body"].read())
    assert held["token"] == mine.me.token
    other = StoreLease("s3://safe/deleted", timeout=60)
    other.me.job = "slurm 999"  # another run (this process's own job may take its lease over)
    with pytest.raises(LeaseHeld):
        other.acquire()

    def broken(**_):
        raise RuntimeError("a bug in the heartbeat")

    mine.timeout, mine._put = 3, broken  # a beat every 0.5 s
    mine._thread = threading.Thread(target=mine._beat, daemon=True)
    mine._thread.start()
    mine._thread.join(10)
    assert not mine._thread.is_alive() and mine.lost
    assert "its heartbeat failed: RuntimeError: a bug in the heartbeat" in mine.lost_to
    assert said[-1].startswith("warning: the lease heartbeat on s3://safe/deleted failed")
    client.delete_object(Bucket="safe", Key="deleted/lease.json")


def test_a_store_that_ignores_conditional_writes_is_refused(s3, tmp_path):
    env, client = s3
    blind = FaultProxy(env["AWS_ENDPOINT_URL"], ignore_conditions=True).start()
    try:
        via = {**env, "AWS_ENDPOINT_URL": blind.url}
        args = [*SAVES, "--checkpoint.folder", "s3://safe/blind", "--training.steps", "2"]
        refused = run_train(tmp_path / "a", *args, nproc=1, env=via, check=False)
        unchecked = run_train(
            tmp_path / "b", *args, "--checkpoint.store_lease", "unchecked", nproc=1, env=via
        )
    finally:
        blind.stop()
    lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert lines[0].startswith(
        "config error: checkpoint.folder s3://safe/blind: this store "
        "ignores conditional writes (If-None-Match)"
    ), lines[0]
    assert "warning: s3://safe/blind: the store ignores conditional writes" in unchecked.stdout
    assert committed("s3://safe/blind") == [2]
    assert not [k for k in prefixes(client, "blind") if k.startswith("lease.json")]


def test_every_transient_fault_is_retried_and_counted(s3, proxy, monkeypatch):
    """Through s3fs (checkpoints, data) and boto3 (the lease): a reset while the body is sent,
    400 RequestTimeout and 400 BadDigest are each sent again and counted; a refused connection
    is not retried (a wrong endpoint says so at once)."""
    import os

    from botocore.exceptions import EndpointConnectionError

    from trainer.checkpoint import retry, storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    lease_client(proxy)
    fs = storage.filesystem("s3://safe/x")
    fs.clear_instance_cache()
    body = os.urandom(4 << 20)
    for kind, counted in (
        ("cut", "resets"),
        ("400timeout", "timeouts"),
        ("baddigest", "server_errors"),
    ):
        for name, send in (
            ("s3fs", lambda k: fs.pipe_file(f"s3://safe/retried/{k}", body)),
            (
                "boto3",
                lambda k: retry.boto3_client().put_object(
                    Bucket="safe", Key=f"retried/{k}", Body=body
                ),
            ),
        ):
            before = retry.counts()
            rule = Rule(r"^PUT /safe/retried/", (kind,), every=1, limit=1)
            proxy.set_rules(rule)
            send(f"{name}-{kind}")
            after = retry.counts()
            assert rule.fired == 1 and after[counted] == before[counted] + 1, (name, kind)
            assert fs.cat_file(f"s3://safe/retried/{name}-{kind}") == body
    proxy.set_rules()
    fs.clear_instance_cache()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    before = retry.counts()
    with pytest.raises(EndpointConnectionError):
        retry.boto3_client().head_bucket(Bucket="safe")
    assert retry.counts()["retries"] == before["retries"]


def test_a_completed_upload_whose_answer_was_lost_is_taken_as_done(s3):
    """MinIO answers the retry of a CompleteMultipartUpload that did complete with NoSuchUpload;
    the object is then taken as written only if its ETag is the one its parts make."""
    import fsspec.asyn

    from trainer.checkpoint import retry, storage

    _, client = s3
    up = client.create_multipart_upload(Bucket="safe", Key="mpu/obj")
    parts = [
        {
            "PartNumber": i + 1,
            "ETag": client.upload_part(
                Bucket="safe",
                Key="mpu/obj",
                UploadId=up["UploadId"],
                PartNumber=i + 1,
                Body=bytes([i]) * (5 << 20),
            )["ETag"],
        }
        for i in range(2)
    ]
    client.complete_multipart_upload(
        Bucket="safe", Key="mpu/obj", UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
    )
    fs = storage.filesystem("s3://safe/mpu")
    ask = {"Bucket": "safe", "Key": "mpu/obj", "UploadId": up["UploadId"]}
    done = fsspec.asyn.sync(
        fs.loop, retry.completed_already, fs, {**ask, "MultipartUpload": {"Parts": parts}}
    )
    assert done["ETag"] == client.head_object(Bucket="safe", Key="mpu/obj")["ETag"]
    assert done["ETag"] == retry.multipart_etag(parts) and done["ETag"].endswith('-2"')
    other = fsspec.asyn.sync(
        fs.loop, retry.completed_already, fs, {**ask, "MultipartUpload": {"Parts": parts[:1]}}
    )
    assert other is None  # another object than these parts make: the error stands
