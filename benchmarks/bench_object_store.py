"""A checkpoint save and load of the debug model: local disk against an S3 server on loopback.

    python benchmarks/bench_object_store.py [--repeats 3] [--flavor debugmodel]

One process, no process group. The state is what the trainer saves of the flavor's model:
its fp32 parameters and AdamW's two moments (random values), written by the trainer's own
DCP writer (trainer/checkpoint/integrity.py: CRC-32 of every byte as it is written; on a URL
fsspec's s3fs, multipart beyond its 50 MiB block) and read back by its safe reader
(trainer/checkpoint/safe_load.py), into a temporary folder and into s3://bench/run/step-N on
`python -m moto.server` started on a free 127.0.0.1 port (pip install -e ".[dev]").
Saves and loads alternate between the two stores, `--repeats` times; the figures are medians.
moto keeps objects in its own (single Python) process's memory: the S3 figures bound what the
client path costs here, not what a real store gives (see docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.checkpoint import integrity, safe_load  # noqa: E402
from trainer.models.args import model_args  # noqa: E402
from trainer.models.llama import build_model  # noqa: E402


def state(flavor: str) -> dict:
    """{model: params, optim: {name: {exp_avg, exp_avg_sq}}}: the trainer's fp32 shapes."""
    with torch.device("meta"):
        model = build_model(model_args(flavor))
    torch.manual_seed(0)
    params = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    moments = {n: {"exp_avg": torch.randn(p.shape), "exp_avg_sq": torch.rand(p.shape)}
               for n, p in params.items()}
    return {"model": params, "optim": moments}


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return server, f"http://127.0.0.1:{port}"


def save(sd: dict, path: str) -> float:
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=integrity.storage_writer(path, 0, 0), no_dist=True)
    return time.perf_counter() - t0


def load(sd: dict, path: str) -> float:
    target = {k: {n: torch.empty_like(t) if torch.is_tensor(t) else
                  {m: torch.empty_like(x) for m, x in t.items()} for n, t in v.items()}
              for k, v in sd.items()}
    t0 = time.perf_counter()
    safe_load.load(target, path, no_dist=True)
    seconds = time.perf_counter() - t0
    assert torch.equal(target["model"]["output.weight"], sd["model"]["output.weight"])
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--flavor", default="debugmodel")
    a = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    server, endpoint = start_moto()
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        sd = state(a.flavor)
        nbytes = 3 * sum(t.numel() * 4 for t in sd["model"].values())
        times = {("local", "save"): [], ("local", "load"): [], ("s3", "save"): [],
                 ("s3", "load"): []}
        with tempfile.TemporaryDirectory(prefix="bench_store_") as tmp:
            for i in range(a.repeats):
                for where, path in (("local", os.path.join(tmp, f"step-{i}")),
                                    ("s3", f"s3://bench/run/step-{i}")):
                    times[(where, "save")].append(save(sd, path))
                    times[(where, "load")].append(load(sd, path))
        print(f"{a.flavor}: {nbytes / 2**20:.1f} MiB (fp32 parameters + AdamW moments), "
              f"median of {a.repeats}, one process, {torch.get_num_threads()} threads")
        print(f"{'store':<28}{'save s':>9}{'save MiB/s':>12}{'load s':>9}{'load MiB/s':>12}")
        for where, label in (("local", "local disk (tmp folder)"),
                             ("s3", "S3 API on loopback (moto)")):
            s, l_ = (statistics.median(times[(where, op)]) for op in ("save", "load"))
            print(f"{label:<28}{s:>9.3f}{nbytes / 2**20 / s:>12.0f}{l_:>9.3f}"
                  f"{nbytes / 2**20 / l_:>12.0f}")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
