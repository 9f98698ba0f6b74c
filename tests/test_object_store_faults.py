"""Faults of an object store: a real S3 API (moto's server, tests/s3_server.py) behind a fault
proxy of our own (scripts/s3_fault_proxy.py) on 127.0.0.1 that answers chosen requests with 503
SlowDown, 500 InternalError, no answer past the client's timeout, or a reset connection.

- In one process: a multipart upload, a token store's ranged block reads and a Hugging Face
  tensor read through every kind of fault: each retried, each counted by its kind
  (trainer/checkpoint/retry.py), exactly as many as the proxy injected; a request the store
  keeps refusing is sent store_retries + 1 times, then fails.
- 2 CPU ranks: a run saving to s3:// trains through faults on its step-2 save, counts them in
  TensorBoard (store/*, summed over the ranks), and, when its step-4 save keeps failing, warns
  and trains on (checkpoint.on_save_error = 'continue'); a second run resumes step 2 through
  faults on its loads, and its step-6 save failing stops it in one line ('stop'). Losses and the
  step-4 tensors are bitwise those of an uninterrupted local run. A third, whose reads of the
  latest step keep failing past the retries, stops in one line rather than resume an older step.
- `scripts/chaos.py --layout s3` in short: a stop signal during a save on top of random store
  faults during every launch's saves and loads; every fault survived, nothing lost.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from scripts.chaos_common import checkpoint_of, committed, train_args
from scripts.s3_fault_proxy import KINDS, FaultProxy, Rule
from tests.helpers import losses, run_train, scalars
from trainer.checkpoint.safe_load import load_tensors

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]')")

STEPS, INTERVAL = 6, 2
TIMEOUT = 8.0  # the in-process test's store timeout (a loaded machine answers some requests
# in seconds: a shorter one times out requests never faulted); the proxy's silence lasts longer
RUN_TIMEOUT = 60.0  # the runs': they meet no injected timeout, and none may be spurious
TAGS = {
    "503": "store/throttled",
    "500": "store/server_errors",
    "timeout": "store/timeouts",
    "reset": "store/resets",
}


@pytest.fixture(scope="module")
def s3():
    from tests.s3_server import s3_server

    with s3_server("chaos", "faults") as (env, client):
        yield env, client


@pytest.fixture(scope="module")
def proxy(s3):
    p = FaultProxy(s3[0]["AWS_ENDPOINT_URL"], delay=TIMEOUT + 1.5).start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run saving locally (chaos.py's job: shared with the chaos test)."""
    dump = tmp_path_factory.mktemp("reference") / "reference"
    run_train(dump, *train_args(dump, STEPS, INTERVAL, 2))
    return dump


def expected(rule: Rule, kind: str) -> int:
    """The faults of `kind` a rule injected (it cycles through its kinds)."""
    return sum(rule.kinds[i % len(rule.kinds)] == kind for i in range(rule.fired))


def test_requests_are_retried_and_counted_by_kind(s3, proxy, monkeypatch, tmp_path):
    from trainer.checkpoint import retry, storage
    from trainer.data.remote import BlockCache
    from trainer.hf.remote import RemoteSafetensors

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    ck = types.SimpleNamespace(
        store_retries=3,
        store_timeout_seconds=TIMEOUT,
        enable=False,
        folder="",
        initial_load_path="",
    )
    retry.configure(
        types.SimpleNamespace(
            checkpoint=ck, data=types.SimpleNamespace(store_path="s3://faults/store", mix=[])
        )
    )
    fs = storage.filesystem("s3://faults/x")
    from safetensors.torch import save_file

    save_file({"w": torch.arange(6.0).reshape(2, 3)}, str(tmp_path / "m.safetensors"))
    fs.put_file(str(tmp_path / "m.safetensors"), "s3://faults/hf/m.safetensors")
    big = os.urandom(11 << 20)
    before, proxy.log[:] = retry.counts(), []
    # every other request faulted; one timeout in ten faults (each costs TIMEOUT seconds)
    proxy.set_rules(
        Rule(
            r"^(GET|PUT|POST|HEAD) /faults/",
            ("503", "500", "reset", "timeout", *("503", "500", "reset") * 2),
            every=2,
        )
    )
    with fs.open("s3://faults/x/big", "wb", block_size=5 << 20) as f:  # 3 parts, multipart
        f.write(big)
    cache = BlockCache(tmp_path / "cache", 1 << 20)
    blocks = [cache.get("s3://faults/x/big", "k", i, len(big)) for i in (0, 5, 9)]
    tensor = RemoteSafetensors("s3://faults/hf/m.safetensors").get_tensor("w")
    proxy.set_rules()
    assert blocks == [big[i * cache.block : (i + 1) * cache.block] for i in (0, 5, 9)]
    assert torch.equal(tensor, torch.arange(6.0).reshape(2, 3))
    after = retry.counts()
    kinds = [line.split()[0] for line in proxy.log]
    assert any("uploadId=" in x for x in proxy.log)  # the multipart upload's requests too
    assert all(kinds.count(k) for k in KINDS), proxy.log  # every kind, in saves and reads
    assert after["retries"] - before["retries"] == len(kinds) >= 8
    for kind, name in TAGS.items():
        assert after[name.split("/")[1]] - before[name.split("/")[1]] == kinds.count(kind)
    # a store that keeps throttling: 1 + store_retries attempts, then the error
    rule = Rule(r"^PUT /faults/x/refused", ("503",), every=1)
    proxy.set_rules(rule)
    with pytest.raises(OSError, match="reduce your request rate"):
        fs.pipe_file("s3://faults/x/refused", b"x")
    proxy.set_rules()
    assert rule.fired == 1 + ck.store_retries
    assert retry.counts()["gave_up"] == after["gave_up"] + 1
    fs.clear_instance_cache()  # its client points at the proxy


def test_training_through_faults_counts_them_and_follows_on_save_error(
    s3, proxy, reference, tmp_path
):
    env = {**s3[0], "AWS_ENDPOINT_URL": proxy.url}
    first, second = tmp_path / "first", tmp_path / "second"
    url = checkpoint_of(first, "s3")
    common = ["--checkpoint.store_timeout_seconds", str(RUN_TIMEOUT)]
    # 1: its step-2 save meets faults (timeouts: the in-process test's, they cost seconds);
    # its step-4 save is refused past the retries
    saves = Rule(r"^(PUT|POST) /chaos/[^/]+/step-2/", ("503", "500", "reset"), every=2, limit=6)
    proxy.set_rules(saves, Rule(r"^(PUT|POST) /chaos/[^/]+/step-4/", ("503",), every=1))
    out = run_train(
        first,
        *train_args(first, 4, INTERVAL, 2, layout="s3"),
        *common,
        "--checkpoint.on_save_error",
        "continue",
        env=env,
    ).stdout
    counted_saves = {k: scalars(first, tag).get(4) for k, tag in TAGS.items()}
    # 2: resumes step 2 through faults on its reads; its step-6 save is refused: it stops
    loads = Rule(r"^(GET|HEAD) /chaos/[^/]+/step-2/", ("reset", "500", "503"), every=2, limit=6)
    proxy.set_rules(loads, Rule(r"^(PUT|POST) /chaos/[^/]+/step-6/", ("500",), every=1))
    stopped = run_train(
        second,
        *train_args(second, STEPS, INTERVAL, 2, layout="s3"),
        *common,
        "--checkpoint.folder",
        url,
        env=env,
        check=False,
    )
    proxy.set_rules()
    ref = losses(reference)

    assert "warning: checkpoint step-4 not saved (" in out and "reduce your request rate" in out
    assert f"the latest checkpoint is {url}/step-2" in out and "step:     4" in out
    assert [losses(first)[s] for s in (1, 2, 3, 4)] == [ref[s] for s in (1, 2, 3, 4)]
    assert saves.fired >= 3 and scalars(first, "store/retries")[4] == saves.fired
    assert counted_saves == {k: expected(saves, k) for k in KINDS}  # each by its kind

    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert f"resumed from {url}/step-2" in stopped.stdout
    assert f"saving {url}/step-6 failed: " in stopped.stdout + stopped.stderr
    assert f"the latest checkpoint is {url}/step-4" in stopped.stdout + stopped.stderr
    got = losses(second)
    assert [got[s] for s in (3, 4, 5, 6)] == [ref[s] for s in (3, 4, 5, 6)]
    assert loads.fired >= 3 and scalars(second, "store/retries")[3] == loads.fired
    assert {k: scalars(second, tag)[3] for k, tag in TAGS.items()} == {
        k: expected(loads, k) for k in KINDS
    }
    assert committed(url) == [2, 4]  # step-6's objects were removed when it failed
    a, b = load_tensors(reference / "checkpoint" / "step-4"), load_tensors(f"{url}/step-4")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # 3: the store keeps refusing step-4's reads past the retries: the resume stops in one line
    # instead of taking step-4 for damaged and silently resuming from step-2
    proxy.set_rules(Rule(r"^(GET|HEAD) /chaos/[^/]+/step-4/", ("503",), every=1))
    third = tmp_path / "third"
    refused = run_train(
        third,
        *train_args(third, STEPS, INTERVAL, 2, layout="s3"),
        *common,
        "--checkpoint.folder",
        url,
        "--checkpoint.store_retries",
        "1",
        env=env,
        check=False,
    )
    proxy.set_rules()
    text = refused.stdout + refused.stderr
    assert refused.returncode == 2, text[-3000:]
    assert f"the object store did not answer while {url}/step-4 was checked" in text
    assert "resuming from the newest intact one" not in text and "step:" not in text


def test_chaos_with_store_faults_loses_nothing(s3, reference, tmp_path):
    from scripts import chaos_store
    from scripts.chaos import ok, report, run_chaos

    with chaos_store.proxied(s3[0], rate=0.05, seed=3) as store:
        fig = run_chaos(
            tmp_path,
            faults=1,
            min_during_save=1,
            steps=STEPS,
            interval=INTERVAL,
            kinds=("launcher-SIGTERM",),
            layout="s3",
            store=store,
            reference=reference,
        )
    print(report(fig, INTERVAL))
    assert fig["store"]["total"] >= 2 and fig["store"]["surfaced"] == 0, fig["store"]
    assert ok(fig, 1, 1), report(fig, INTERVAL)
