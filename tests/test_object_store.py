"""Checkpoints on an object store: a real S3 HTTP API (moto's server) on 127.0.0.1, 2 CPU ranks.

One async run saves to s3://ckpt/run1 and stops at step 3, a second resumes it to step 6
(past a step-6 whose save was cut off before its commit): steps 4-6 equal a local run's bit
for bit. A 1-rank run then resumes step 3 from the bucket
(the weights it loads equal what the 2 ranks loaded; the whole state, AdamW's moments included,
read on one process equals the local folder's), sets the later step-6 aside and prunes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import BASE_FP32, losses, run_train, subprocess_env

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]')")

URL = "s3://ckpt/run1"
COMMON = [
    *BASE_FP32,
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.async_mode",
    "async",
    "--checkpoint.keep_latest_k",
    "0",
]
DIGEST = {"TRAINER_DEBUG_WEIGHT_DIGEST": "1"}


@pytest.fixture(scope="module")
def s3():
    """Environment variables that point boto3 and s3fs at a moto server on a free loopback
    port, with the bucket `ckpt` created (tests/s3_server.py)."""
    from tests.s3_server import s3_server

    with s3_server("ckpt") as served:
        yield served


def bucket(client) -> dict[str, set[str]]:
    """{step folder: its object names} under s3://ckpt/run1."""
    out: dict[str, set[str]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="ckpt", Prefix="run1/"):
        for obj in page.get("Contents", []):
            _, folder, *name = obj["Key"].split("/", 2)
            out.setdefault(folder, set()).update(name)
    return out


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    dump = tmp_path_factory.mktemp("local") / "run"
    run_train(dump, *COMMON, "--training.steps", "6")
    return dump


@pytest.fixture(scope="module")
def on_s3(s3, tmp_path_factory):
    """(dump, stdout of the resume, the bucket after the first run, the bucket after both)."""
    env, client = s3
    dump = tmp_path_factory.mktemp("s3") / "run"
    run_train(dump, *COMMON, "--checkpoint.folder", URL, "--training.steps", "3", env=env)
    first = bucket(client)
    for name in (".metadata", "__0_0.distcp", "__7_0.distcp"):  # a save cut off before its
        client.put_object(Bucket="ckpt", Key=f"run1/step-6/{name}", Body=b"\0" * 64)  # commit
    out = run_train(
        dump, *COMMON, "--checkpoint.folder", URL, "--training.steps", "6", env={**env, **DIGEST}
    ).stdout
    return dump, out, first, bucket(client)


def test_resume_from_s3_is_bitwise_a_local_run(local, on_s3):
    dump, out, first, both = on_s3
    assert f"resumed from {URL}/step-3" in out
    ref, got = losses(local), losses(dump)
    assert [got[s] for s in (4, 5, 6)] == [ref[s] for s in (4, 5, 6)]
    assert set(first) == {"step-3"} and set(both) == {"step-3", "step-6"}  # lease released
    # each rank's share in checkpoint.store_threads (8) files written at once, the metadata,
    # the manifest (the commit); the cut-off save's are gone
    shards = {f"__{rank}_{i}.distcp" for rank in range(2) for i in range(8)}
    for names in both.values():
        assert names == shards | {".metadata", "manifest.json"}
    assert not (dump / "checkpoint").exists()
    named = [
        os.path.join(d, n)
        for d, dirs, files in os.walk(dump.parent)
        for n in dirs + files
        if n.startswith("s3") or n in ("ckpt", "run1")
    ]
    assert named == [], named


def test_initial_load_path_reads_a_bucket_as_a_local_folder(s3, local, on_s3, tmp_path):
    """checkpoint.initial_load_path = s3://.../step-3 (the model of another run): the first
    step's loss is bitwise that of the same start from the local run's step-3."""
    env, _ = s3
    got = {}
    for name, path in (("local", local / "checkpoint" / "step-3"), ("s3", f"{URL}/step-3")):
        out = run_train(
            tmp_path / name,
            *BASE_FP32,
            "--checkpoint.initial_load_path",
            str(path),
            "--training.steps",
            "1",
            nproc=1,
            env=env,
        ).stdout
        assert f"initialised the model from {path}" in out, out
        got[name] = losses(tmp_path / name)
    assert got["s3"] == got["local"] and len(got["s3"]) == 1


def whole_state(path: str) -> dict:
    """Every tensor of a checkpoint (weights, AdamW moments and steps), read on this one
    process: DCP reshards the 2 ranks' save as a 1-rank resume reads it."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer.checkpoint import safe_load

    meta = safe_load.read_metadata(path).state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata) and k.startswith("model_optim.")
    }
    safe_load.load(state, path, no_dist=True)
    return state


def test_resume_on_one_rank_from_s3(s3, local, on_s3):
    """Step 3 loads on 1 rank as it did on 2 (the same weights, gathered), and the whole
    state read on one process from the bucket is the local folder's, optimizer included; the
    save of step 4 sets the later step-6 aside (a branch point: its manifest renamed, its data
    left in place, nothing copied) and keep_latest_k = 1 deletes step-3."""
    import torch

    env, client = s3
    dump, two_ranks = on_s3[0], on_s3[1]
    here, there = whole_state(str(local / "checkpoint" / "step-3")), whole_state(f"{URL}/step-3")
    assert sorted(here) == sorted(there) and any(".exp_avg_sq" in k for k in here)
    assert all(torch.equal(here[k], there[k]) for k in here)
    out = run_train(
        dump.parent / "one",
        *COMMON,
        "--checkpoint.folder",
        URL,
        "--checkpoint.load_step",
        "3",
        "--checkpoint.keep_latest_k",
        "1",
        "--training.steps",
        "4",
        nproc=1,
        env={**env, **DIGEST},
    ).stdout
    digest = [line.split()[-1] for line in out.splitlines() if "loaded weights digest" in line]
    assert digest and digest == [
        line.split()[-1] for line in two_ranks.splitlines() if "loaded weights digest" in line
    ]
    after = bucket(client)
    assert "step-4" in after and "step-3" not in after and "manifest.json" in after["step-4"]
    marker = [n for n in after["step-6"] if n.startswith("manifest.abandoned-")]
    assert len(marker) == 1 and "manifest.json" not in after["step-6"], after
    assert after["step-6"] - set(marker) == on_s3[3]["step-6"] - {"manifest.json"}  # in place
    assert set(after) == {"step-4", "step-6"}, after


def test_missing_bucket_is_one_line(s3, tmp_path):
    env, _ = s3
    proc = run_train(
        tmp_path / "run",
        *BASE_FP32,
        "--checkpoint.enable",
        "true",
        "--checkpoint.folder",
        "s3://no-such-bucket/run",
        "--training.steps",
        "1",
        nproc=1,
        env=env,
        check=False,
    )
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and "bucket 'no-such-bucket' does not exist" in errors[0], errors
    assert "step 1" not in proc.stdout.lower()


def test_other_schemes_refused_and_no_client_imported_without_a_url():
    """In a fresh process: other schemes are config errors naming the valid ones, and the
    trainer, its checkpointer and a local checkpoint folder's config import no store client."""
    code = """if True:
        import sys
        import trainer.train, trainer.checkpoint.checkpointer
        from trainer.config.job import load_config
        from trainer.errors import ConfigError
        load_config(["--checkpoint.enable", "true"])
        for key, url in (("folder", "http://host/ckpt"), ("initial_load_path", "hdfs://nn/x")):
            try:
                load_config([f"--checkpoint.{key}", url])
            except ConfigError as e:
                print(e.one_line())
        print(sorted(m for m in ("s3fs", "gcsfs", "fsspec", "boto3") if m in sys.modules))
    """
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=True,
    ).stdout.splitlines()
    assert out == [
        "config error: checkpoint.folder = 'http://host/ckpt': the scheme http:// is not "
        "supported; use a local folder, s3://bucket/prefix or gs://bucket/prefix",
        "config error: checkpoint.initial_load_path = 'hdfs://nn/x': the scheme hdfs:// is not "
        "supported; use a local folder, s3://bucket/prefix or gs://bucket/prefix",
        "[]",
    ]


def lease_record(**changes) -> bytes:
    record = {
        "host": "elsewhere",
        "job": "slurm 1",
        "pid": 1,
        "start": "",
        "since": time.time(),
        "heartbeat": time.time(),
        "token": "theirs",
    }
    return json.dumps({**record, **changes}).encode()


def test_a_live_run_holding_the_bucket_folder_keeps_another_out(s3, on_s3, tmp_path):
    """Another dump folder, the same s3:// checkpoint folder: refused in one line while the
    holder's heartbeat is fresh (the lease is taken with If-None-Match: *), on every rank
    alike (rank 1 used to fail as if rank 0 had died, and record it in failures.jsonl)."""
    env, client = s3
    client.put_object(Bucket="ckpt", Key="run2/lease.json", Body=lease_record())
    now = bucket(client)  # the bucket as the module's earlier tests left it
    step = max(
        (f for f in now if re.fullmatch(r"step-\d+", f) and "manifest.json" in now[f]),
        key=lambda f: int(f.split("-")[1]),
    )
    for name in now[step]:  # a committed step: the ranks would verify it together
        client.copy_object(
            Bucket="ckpt",
            Key=f"run2/{step}/{name}",
            CopySource={"Bucket": "ckpt", "Key": f"run1/{step}/{name}"},
        )
    proc = run_train(
        tmp_path / "run",
        *BASE_FP32,
        "--checkpoint.enable",
        "true",
        "--checkpoint.folder",
        "s3://ckpt/run2",
        "--training.steps",
        "1",
        nproc=2,
        env=env,
        check=False,
    )
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "failures.jsonl").exists()
    assert (
        "checkpoint.folder s3://ckpt/run2 is in use by another run: slurm 1 on elsewhere"
        in errors[0]
    )


def test_store_lease_takes_over_a_stale_one_and_releases(s3):
    """In this process against the server: a stale lease is replaced with If-Match (the ETag
    judged stale), a refresh after another run's takeover finds it lost, a release deletes
    only its own."""
    from trainer.checkpoint.lease import LeaseHeld
    from trainer.checkpoint.store_lease import StoreLease

    _, client = s3
    client.put_object(
        Bucket="ckpt", Key="run3/lease.json", Body=lease_record(heartbeat=time.time() - 1000)
    )
    with pytest.raises(LeaseHeld, match="in use by another run"):  # the store's clock: fresh
        StoreLease("s3://ckpt/run3", timeout=60).acquire()
    time.sleep(2.5)  # the store's Date has whole seconds: at least 1.5 s old by its clock
    said = []
    mine = StoreLease("s3://ckpt/run3", timeout=1, log=said.append)
    mine.acquire()
    assert "taking over the lease of slurm 1 on elsewhere" in said[0] and "no heartbeat" in said[0]
    held = json.loads(client.get_object(Bucket="ckpt", Key="run3/lease.json")["Body"].read())
    assert held["token"] == mine.me.token
    mine._put()  # a refresh that landed, its answer lost (the retry is refused: a stale ETag)
    assert mine.refresh() and mine.refresh() and not getattr(mine, "lost", False)
    client.put_object(Bucket="ckpt", Key="run3/lease.json", Body=lease_record())  # taken over
    assert not mine.refresh() and mine.lost_to == "s3://ckpt/run3 (another run took it over)"
    mine.release()  # not ours any more: stays
    assert (
        json.loads(client.get_object(Bucket="ckpt", Key="run3/lease.json")["Body"].read())["token"]
        == "theirs"
    )
    client.delete_object(Bucket="ckpt", Key="run3/lease.json")
    again = StoreLease("s3://ckpt/run3", timeout=60)
    again.acquire()
    again.release()
    assert "Contents" not in client.list_objects_v2(Bucket="ckpt", Prefix="run3/")


def test_rollback_resaves_its_step_in_the_bucket(s3, tmp_path):
    """A loss spike at step 6 reloads step-4 from the bucket and saves it again to a fresh
    prefix, step-4.2 (the old step-4 set aside by renaming its manifest, no data copied, and
    deleted once the new one is committed); the save of step 8 fails
    (an injected I/O error) and the run ends with step-6 the latest (on_save_error)."""
    env, client = s3
    out = run_train(
        tmp_path / "run",
        *BASE_FP32,
        "--checkpoint.enable",
        "true",
        "--checkpoint.folder",
        "s3://ckpt/run4",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        "--training.spike_window",
        "3",
        "--training.on_spike",
        "rollback",
        "--training.steps",
        "8",
        "--checkpoint.on_save_error",
        "continue",
        nproc=1,
        env={**env, "TRAINER_TEST_SPIKE_LOSS": "0:6:20", "TRAINER_TEST_SAVE_ERROR": "8:5"},
    ).stdout
    assert "rolled back to checkpoint step-4" in out, out
    assert (
        "warning: checkpoint step-8 not saved ([Errno 5] Input/output error: "
        "'s3://ckpt/run4/step-8/__injected.distcp'); training goes on "
        "(checkpoint.on_save_error = 'continue'); the latest checkpoint is "
        "s3://ckpt/run4/step-6"
    ) in out, out
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix="run4/")["Contents"]}
    assert {k.split("/")[1] for k in keys} == {"step-2", "step-4.2", "step-6"}, keys
    assert "rolled back to checkpoint step-4" in out and "s3://ckpt/run4/step-4.2 in " in out
    manifest = json.loads(
        client.get_object(Bucket="ckpt", Key="run4/step-4.2/manifest.json")["Body"].read()
    )
    assert manifest["step"] == 4
    assert set(manifest["files"]) == {".metadata", *(f"__0_{i}.distcp" for i in range(8))}


def test_a_changed_endpoint_gets_a_client_of_its_own(monkeypatch):
    """fsspec caches one file system per argument set: the endpoint is one of them, so a client
    made for an endpoint that went away (another server) never serves a later one."""
    from trainer.checkpoint import storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    first = storage.filesystem("s3://b/x")
    assert storage.filesystem("s3://b/y") is first  # one per endpoint, reused
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
    second = storage.filesystem("s3://b/x")
    assert second is not first and second.endpoint_url == "http://127.0.0.1:2"
