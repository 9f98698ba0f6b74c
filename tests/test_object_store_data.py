"""Token stores and Hugging Face folders on an object store: a real S3 HTTP API (moto's
server, tests/s3_server.py) on 127.0.0.1, nothing reaches the network.

A store prepared to s3:// with `python -m trainer.data.prepare` trains on 2 CPU ranks bit for
bit as the same store on local disk, through a block cache whose tiny bound forces evictions,
and rank 0 fetches less than the whole store. A missing bucket and an unreachable endpoint
are one line, exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import BASE_FP32, losses, run_train, scalars, subprocess_env
from tests.s3_server import s3_server

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]')")

URL = "s3://data/email"
CACHE_GIB = 0.00003  # ~32 KiB: 4 KiB blocks, 7 of them fit
STORE_ARGS = ["--dataset", "stdlib", "--data_files", "email/**", "--workers", "1",
              "--shard_tokens", "20000"]


@pytest.fixture(scope="module")
def s3():
    with s3_server("data") as server:
        yield server


@pytest.fixture(scope="module")
def stores(s3, tmp_path_factory):
    """(local store, its size in bytes): the same source prepared on disk and to URL."""
    from tests.test_data_fixtures import stdlib_texts
    from trainer.data.config import DataConfig
    from trainer.data.tokenizer import train_bpe
    from trainer.data.writer import prepare_store

    env, _ = s3
    base = tmp_path_factory.mktemp("stores")
    tok = str(train_bpe(stdlib_texts(30), 512, base / "tok.model", num_threads=1))
    cfg = DataConfig(dataset="stdlib", data_files=["email/**"], tokenizer_path=tok)
    manifest = prepare_store(cfg, tok, str(base / "local"), workers=1, shard_tokens=20000,
                             show_progress=False)
    proc = subprocess.run([sys.executable, "-m", "trainer.data.prepare", *STORE_ARGS,
                           "--tokenizer_path", tok, "--store_path", URL,
                           "--cache_dir", str(base / "staging")],
                          env=subprocess_env(env), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"uploaded to {URL}" in proc.stdout
    return base / "local", manifest["total_tokens"] * 2


def train(dump, store: str, env: dict, *extra: str):
    return run_train(dump, *BASE_FP32, "--data.dataset", "stdlib", "--data.store_path", store,
                     "--training.steps", "3", *extra, env=env)


def test_a_store_in_a_bucket_trains_as_on_disk_through_a_bounded_cache(s3, stores, tmp_path):
    env, _ = s3
    local, store_bytes = stores
    train(tmp_path / "local", str(local), env)
    cache = tmp_path / "cache"
    secrets = {"AWS_ACCESS_KEY_ID": "AKIDH6KEYID", "AWS_SECRET_ACCESS_KEY": "h6-secret-key"}
    proc = train(tmp_path / "s3", URL, {**env, **secrets}, "--data.cache_dir", str(cache),
                 "--data.cache_max_gib", str(CACHE_GIB))
    out = proc.stdout
    assert f"token store {URL}" in out and "sizes verified" in out, out
    ref, got = losses(tmp_path / "local"), losses(tmp_path / "s3")
    assert len(got) == 3 and got == ref
    fetched = scalars(tmp_path / "s3", "data_metrics/store_fetched_mib")
    used = scalars(tmp_path / "s3", "data_metrics/cache_used_mib")
    evicted = scalars(tmp_path / "s3", "data_metrics/cache_evictions")
    bound = CACHE_GIB * 1024
    assert 0 < fetched[3] < store_bytes / (1 << 20)  # rank 0 read part of the store
    assert max(used.values()) <= bound and evicted[3] > 0, (used, evicted)
    on_disk = sum(f.stat().st_size for f in (cache / "remote-blocks").iterdir()
                  if not f.name.startswith("."))
    assert 0 < on_disk <= CACHE_GIB * (1 << 30)
    # the effective config keeps the URL and nothing of the credentials; nor do the logs
    saved = (tmp_path / "s3" / "config.toml").read_text()
    assert URL in saved
    for text in (saved, proc.stdout, proc.stderr):
        assert not any(secret in text for secret in secrets.values())


def one_error_line(proc) -> str:
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, proc.stderr[-2000:])
    return errors[0]


def test_a_missing_bucket_is_one_line_before_any_step(s3, tmp_path):
    env, _ = s3
    proc = run_train(tmp_path / "run", *BASE_FP32, "--data.dataset", "stdlib",
                     "--data.store_path", "s3://no-such-bucket/store", "--training.steps", "1",
                     nproc=1, env=env, check=False)
    assert "data.store_path = 's3://no-such-bucket/store': the bucket 'no-such-bucket' does " \
           "not exist" in one_error_line(proc)
    assert "step 1" not in proc.stdout.lower()


def test_an_unreachable_endpoint_is_one_line(s3, stores, tmp_path):
    env, _ = s3
    with __import__("socket").socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    bad = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_MAX_ATTEMPTS": "1"}
    proc = subprocess.run([sys.executable, "-m", "trainer.data.prepare", *STORE_ARGS,
                           "--tokenizer_path", str(stores[0] / "tokenizer.model"),
                           "--store_path", "s3://data/other"], env=subprocess_env(bad),
                          capture_output=True, text=True, timeout=120)
    line = one_error_line(proc)
    assert line.startswith("config error: data.store_path = 's3://data/other': cannot reach "
                           f"the store at http://127.0.0.1:{port}"), line
    assert "test" not in line  # no credentials
