"""DCP saves and loads on s3:// with one file per rank in flight against several.

    python benchmarks/checkpoint/bench_store_threads.py [--gib 1] [--threads 8] [--repeats 3]

One process, one run: a state of `--gib` GiB (fp32 tensors of 64 MiB) saved and loaded
through the trainer's own writer and reader (trainer/checkpoint/integrity.py storage_writer,
safe_load.load: DCP's fsspec writer and reader over s3fs) against moto's S3 API on loopback
(benchmarks/checkpoint/s3_loopback.py), with `checkpoint.store_threads` = 1 (DCP's default: the
rank's share is one file, its multipart parts sent one after another) and = `--threads` (the share
split into that many files written at once; a load reads as many at once), interleaved
within each repeat. The loaded state is checked equal to the saved one.

Columns: MiB/s (median and range), the server's CPU seconds and its share of the wall time
(moto is one Python process: near 1.0 it is the bound, and a faster store would show what the
client can do), this process's CPU seconds, and the S3 operations the server saw.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed.checkpoint as dcp  # noqa: E402

from benchmarks.checkpoint.s3_loopback import BUCKET, Server  # noqa: E402
from trainer.checkpoint import integrity, safe_load, storage  # noqa: E402

MIB = 1 << 20
TENSOR_MIB = 64


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_state(gib: float) -> dict[str, torch.Tensor]:
    n = max(1, round(gib * 1024 / TENSOR_MIB))
    gen = torch.Generator().manual_seed(0)
    numel = TENSOR_MIB * MIB // 4
    return {f"w{i}": torch.rand(numel, generator=gen) for i in range(n)}


def save(state: dict, url: str, threads: int) -> None:
    writer = integrity.storage_writer(url, step=0, rank=0, threads=threads)
    dcp.save(state, storage_writer=writer, no_dist=True)


def load(state: dict, url: str, threads: int) -> dict:
    out = {k: torch.empty_like(v) for k, v in state.items()}
    safe_load.load(out, url, no_dist=True, threads=threads)
    return out


def timed(server: Server, fn, *args):
    c0, s0, n0 = own_cpu(), server.cpu(), server.counts()
    t0 = time.perf_counter()
    out = fn(*args)
    wall = time.perf_counter() - t0
    return out, (wall, server.cpu() - s0, own_cpu() - c0, server.counts() - n0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    server = Server()
    state = make_state(args.gib)
    mib = sum(t.numel() * 4 for t in state.values()) / MIB
    rows: dict[str, list] = defaultdict(list)
    try:
        for rep in range(args.repeats):
            for threads in (1, args.threads):
                url = f"s3://{BUCKET}/threads-{threads}-{rep}"
                _, row = timed(server, save, state, url, threads)
                rows[f"save, store_threads = {threads}"].append(row)
                got, row = timed(server, load, state, url, threads)
                rows[f"load, store_threads = {threads}"].append(row)
                assert all(torch.equal(got[k], state[k]) for k in state), "loaded != saved"
                del got
                storage.remove_tree(url)
    finally:
        server.proc.terminate()
    report(rows, mib, args)
    return 0


def report(rows: dict[str, list], mib: float, args) -> None:
    print(
        f"DCP on s3:// (moto on loopback), {mib:.0f} MiB in {TENSOR_MIB} MiB tensors, "
        f"{args.repeats} repeats, torch {torch.__version__}"
    )
    print(
        f"{'':<28}{'MiB/s (range)':>20}{'srv CPU s':>11}{'srv/wall':>10}{'own CPU s':>11}"
        "  S3 operations (last repeat)"
    )
    for label, got in rows.items():
        rates = [mib / wall for wall, *_ in got]
        wall = statistics.median(r[0] for r in got)
        srv = statistics.median(r[1] for r in got)
        own = statistics.median(r[2] for r in got)
        ops = ", ".join(f"{k} {v}" for k, v in sorted(got[-1][3].items()) if v > 0)
        print(
            f"{label:<28}{statistics.median(rates):>8.0f} ({min(rates):>4.0f}-{max(rates):<5.0f})"
            f"{srv:>11.2f}{srv / wall:>10.2f}{own:>11.2f}  {ops}"
        )
    for kind in ("save", "load"):
        one = statistics.median(mib / r[0] for r in rows[f"{kind}, store_threads = 1"])
        many = statistics.median(
            mib / r[0] for r in rows[f"{kind}, store_threads = {args.threads}"]
        )
        print(f"{kind}: store_threads = {args.threads} is {many / one:.2f}x store_threads = 1")


if __name__ == "__main__":
    raise SystemExit(main())
