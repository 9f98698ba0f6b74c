"""Token stores and Hugging Face folders on an object store: a real S3 HTTP API (moto's
server, tests/s3_server.py) on 127.0.0.1, nothing reaches the network.

A store prepared to s3:// with `python -m trainer.data.prepare` trains on 2 CPU ranks bit for
bit as the same store on local disk, through a block cache whose tiny bound forces evictions,
and rank 0 fetches less than the whole store. A missing bucket and an unreachable endpoint
are one line, exit 2.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.helpers import BASE_FP32, STDLIB, fork_python, losses, run_train, scalars
from tests.s3_server import s3_server

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]')")

URL = "s3://data/email"
CACHE_GIB = 0.00003  # ~32 KiB: 4 KiB blocks, 7 of them fit
STORE_ARGS = [
    "--dataset",
    "stdlib",
    "--data_files",
    "email/**",
    "--workers",
    "1",
    "--shard_tokens",
    "20000",
]


@pytest.fixture(scope="module")
def s3():
    with s3_server("data") as server:
        yield server


@pytest.fixture(scope="module")
def stores(s3, tmp_path_factory):
    """(local store, its size in bytes): the same source prepared on disk and to URL."""
    from tests.data_fixtures import stdlib_texts
    from trainer.data.config import DataConfig
    from trainer.data.tokenizer import train_bpe
    from trainer.data.writer import prepare_store

    env, _ = s3
    base = tmp_path_factory.mktemp("stores")
    tok = str(train_bpe(stdlib_texts(30), 512, base / "tok.model", num_threads=1))
    cfg = DataConfig(dataset="stdlib", data_files=["email/**"], tokenizer_path=tok)
    manifest = prepare_store(
        cfg, tok, str(base / "local"), workers=1, shard_tokens=20000, show_progress=False
    )
    python, run_env = fork_python(env)
    proc = subprocess.run(
        [
            python,
            "-m",
            "trainer.data.prepare",
            *STORE_ARGS,
            "--tokenizer_path",
            tok,
            "--store_path",
            URL,
            "--cache_dir",
            str(base / "staging"),
        ],
        env=run_env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"uploaded to {URL}" in proc.stdout
    return base / "local", manifest["total_tokens"] * 2


def train(dump, store: str, env: dict, *extra: str):
    return run_train(
        dump,
        *BASE_FP32,
        *STDLIB,
        "--data.store_path",
        store,
        "--training.steps",
        "3",
        "--checkpoint.last_save_in_hf",
        "true",
        *extra,
        env=env,
    )


SECRETS = {"AWS_ACCESS_KEY_ID": "AKIDH6KEYID", "AWS_SECRET_ACCESS_KEY": "h6-secret-key"}


@pytest.fixture(scope="module")
def runs(s3, stores, tmp_path_factory):
    """(local run's dump, bucket run's dump, its process, its cache folder): 2 ranks, 3 steps
    each; the bucket run reads s3://data/email and saves its checkpoints to s3://data/ckpt."""
    env, _ = s3
    base = tmp_path_factory.mktemp("runs")
    train(base / "local", str(stores[0]), env)
    proc = train(
        base / "s3",
        URL,
        {**env, **SECRETS},
        "--data.block_cache_dir",
        str(base / "cache"),
        "--data.cache_max_gib",
        str(CACHE_GIB),
        "--checkpoint.enable",
        "true",
        "--checkpoint.folder",
        "s3://data/ckpt",
        "--checkpoint.interval",
        "3",
    )
    return base / "local", base / "s3", proc, base / "cache"


def test_a_store_in_a_bucket_trains_as_on_disk_through_a_bounded_cache(stores, runs):
    store_bytes = stores[1]
    local, dump, proc, cache = runs
    assert f"token store {URL}" in proc.stdout and "sizes verified" in proc.stdout, proc.stdout
    ref, got = losses(local), losses(dump)
    assert len(got) == 3 and got == ref
    fetched = scalars(dump, "data_metrics/store_fetched_mib")
    used = scalars(dump, "data_metrics/cache_used_mib")
    evicted = scalars(dump, "data_metrics/cache_evictions")
    assert 0 < fetched[3] < store_bytes / (1 << 20)  # rank 0 read part of the store
    assert max(used.values()) <= CACHE_GIB * 1024 and evicted[3] > 0, (used, evicted)
    on_disk = sum(
        f.stat().st_size for f in (cache / "remote-blocks").iterdir() if not f.name.startswith(".")
    )
    assert 0 < on_disk <= CACHE_GIB * (1 << 30)
    # the effective config keeps the URL and nothing of the credentials; nor do the logs
    saved = (dump / "config.toml").read_text()
    assert URL in saved
    for text in (saved, proc.stdout, proc.stderr):
        assert not any(secret in text for secret in SECRETS.values())


def objects(client, prefix: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket="data", Prefix=prefix + "/").get("Contents", [])
    return {
        o["Key"].rsplit("/", 1)[1]: client.get_object(Bucket="data", Key=o["Key"])["Body"].read()
        for o in listed
    }


def test_hf_folders_to_and_from_a_bucket_equal_the_local_ones(s3, runs, tmp_path):
    """last_save_in_hf beside an s3:// checkpoint folder uploads the folder the local run
    writes; `convert to-hf` from the bucket's step-3 to the bucket writes the same files; a
    HF folder read from the bucket (ranged reads) gives the local folder's tensors."""
    from trainer.hf.weights import HFFolder

    env, client = s3
    local, dump = runs[0] / "hf", runs[1] / "hf"
    files = {p.name: p.read_bytes() for p in local.iterdir()}
    assert "model.safetensors" in files and files == {
        p.name: p.read_bytes() for p in dump.iterdir()
    }
    assert objects(client, "ckpt/hf") == files
    python, run_env = fork_python(env)
    proc = subprocess.run(
        [
            python,
            "-m",
            "trainer.convert",
            "to-hf",
            "s3://data/ckpt/step-3",
            "s3://data/converted",
            "--config",
            str(runs[1] / "config.toml"),
        ],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert objects(client, "converted") == files
    remote, here = HFFolder("s3://data/converted"), HFFolder(str(local))
    assert remote.config == here.config and sorted(remote.weight_map) == sorted(here.weight_map)
    for key in here.weight_map:
        assert torch.equal(remote.tensor(key), here.tensor(key)), key


def generated(*args: str) -> tuple[int, str, str]:
    """`python -m trainer.generate` in this process (the server's variables are set here):
    (exit code, stdout, stderr)."""
    import contextlib
    import io

    from trainer.generate import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--prompt", "def ", "--max_new_tokens", "12", *args])
    return code, out.getvalue(), err.getvalue()


def test_generate_reads_a_checkpoint_and_a_hf_folder_in_a_bucket(runs):
    """The bucket run's step-3 (DCP at s3://) and its HF export at s3:// generate, greedily,
    the text that its local HF folder does (the same fp32 weights); the run's tokenizer is the
    store's at s3://, fetched through the cache. A URL without --config is one line."""
    config = str(runs[1] / "config.toml")
    local = generated("--checkpoint", str(runs[1] / "hf"))
    assert local[0] == 0 and local[1].startswith("def ") and len(local[1]) > 8, local
    for url in ("s3://data/ckpt/step-3", "s3://data/ckpt/hf"):
        assert generated("--checkpoint", url, "--config", config)[:2] == local[:2], url
    code, _, err = generated("--checkpoint", "s3://data/ckpt/step-3")
    assert code == 2 and err.strip() == (
        "config error: --checkpoint s3://data/ckpt/step-3 is in an object store, away from "
        "its run's config.toml: pass --config {dump_folder}/config.toml"
    ), err


def one_error_line(proc) -> str:
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, proc.stderr[-2000:])
    return errors[0]


def test_a_missing_bucket_is_one_line_before_any_step(s3, tmp_path):
    env, _ = s3
    proc = run_train(
        tmp_path / "run",
        *BASE_FP32,
        *STDLIB,
        "--data.store_path",
        "s3://no-such-bucket/store",
        "--training.steps",
        "1",
        nproc=1,
        env=env,
        check=False,
    )
    assert (
        "data.store_path = 's3://no-such-bucket/store': the bucket 'no-such-bucket' does "
        "not exist" in one_error_line(proc)
    )
    assert "step 1" not in proc.stdout.lower()


def test_an_unreachable_endpoint_is_one_line(s3, stores, tmp_path):
    env, _ = s3
    with __import__("socket").socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    bad = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_MAX_ATTEMPTS": "1"}
    python, run_env = fork_python(bad)
    proc = subprocess.run(
        [
            python,
            "-m",
            "trainer.data.prepare",
            *STORE_ARGS,
            "--tokenizer_path",
            str(stores[0] / "tokenizer.model"),
            "--store_path",
            "s3://data/other",
        ],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_error_line(proc)
    assert line.startswith(
        "config error: data.store_path = 's3://data/other': cannot reach "
        f"the store at http://127.0.0.1:{port}"
    ), line
    assert "test" not in line  # no credentials
