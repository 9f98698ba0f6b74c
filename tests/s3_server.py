"""A real S3 HTTP API on 127.0.0.1 for tests: moto's server on a free loopback port (as s3fs's
own suite does); nothing reaches the network."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time


@contextlib.contextmanager
def s3_server(*buckets: str):
    """Yields (environment variables that point boto3 and s3fs at the server, a boto3
    client) with `buckets` created; the variables are also set in this process meanwhile."""
    import boto3

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    env_before = {k: os.environ.get(k) for k in env}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        client = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )
        for name in buckets:
            client.create_bucket(Bucket=name)
        os.environ.update(env)  # for this process's own reads and listings too
        _forget_clients()
        yield env, client
    finally:
        _forget_clients()
        for key, value in env_before.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        server.terminate()
        server.wait(timeout=10)


def _forget_clients() -> None:
    """Drop fsspec's cached s3 file systems: one made for another module's server (DCP's
    readers and writers key theirs on the URL alone) would still point at its dead port."""
    import fsspec

    fsspec.get_filesystem_class("s3").clear_instance_cache()
