"""moto's S3 server on loopback behind a WSGI layer that counts the S3 operations it serves,
for benchmarks/checkpoint/bench_object_store.py. Started as tests/s3_server.py starts moto (a free
127.0.0.1 port, `AWS_*` variables pointing at it); a layer of its own because the benchmark
needs the operation counts (multipart uploads, ranged GETs) and the server's CPU time, and a
fix of moto 5.2's CompleteMultipartUpload answer for s3torchconnector (below).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

BUCKET = "bench"
# moto's server behind a WSGI layer that counts operations (GET /__bench__/counts) and, once
# switched on (GET /__bench__/compat?on), names CompleteMultipartUpload's XML root as S3 does
# (CompleteMultipartUploadResult; moto 5.2 writes ...Response, which s3torchconnector's CRT
# client cannot read: 'Header "ETag" not found').
SERVER = r"""
import collections, json, sys
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple
app, counts, compat = DomainDispatcherApplication(create_backend_app), collections.Counter(), [0]
def op(e):
    m, q, key = e["REQUEST_METHOD"], e.get("QUERY_STRING", ""), "/" in e["PATH_INFO"].strip("/")
    if m == "POST":
        return ("CreateMultipartUpload" if q.startswith("uploads") else
                "CompleteMultipartUpload" if "uploadId=" in q else "DeleteObjects")
    if m == "PUT":
        return ("UploadPart" if "partNumber=" in q else "CopyObject" if
                "HTTP_X_AMZ_COPY_SOURCE" in e else "PutObject" if key else "CreateBucket")
    if m == "GET":
        return ("GetObject (ranged)" if "HTTP_RANGE" in e else "GetObject") if key else "List"
    return m.capitalize() + ("Object" if key else "Bucket")
def layer(e, start_response):
    if e["PATH_INFO"].startswith("/__bench__/"):
        if e["PATH_INFO"].endswith("compat"):
            compat[0] = e.get("QUERY_STRING") == "on"
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(counts).encode()]
    name = op(e)
    counts[name] += 1
    if not (compat[0] and name == "CompleteMultipartUpload"):
        return app(e, start_response)
    got = {}
    body = b"".join(app(e, lambda status, headers, *a: got.update(s=status, h=headers)))
    body = body.replace(b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult")
    headers = [(k, v) for k, v in got["h"] if k.lower() != "content-length"]
    start_response(got["s"], headers + [("Content-Length", str(len(body)))])
    return [body]
run_simple("127.0.0.1", int(sys.argv[1]), layer, threaded=True)
"""


class Server:
    """moto's S3 API on a free loopback port, with the AWS_* variables pointing at it."""

    def __init__(self):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.endpoint = f"http://127.0.0.1:{self.port}"
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        os.environ.update(
            {
                "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        )
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)

    def counts(self, compat: bool | None = None) -> Counter:
        query = "" if compat is None else "?on" if compat else "?off"
        path = "compat" + query if compat is not None else "counts"
        with urllib.request.urlopen(f"{self.endpoint}/__bench__/{path}") as r:
            return Counter(json.loads(r.read()))

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
