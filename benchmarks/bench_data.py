"""Data pipeline throughput: loader tokens/s per rank from a token store, and prepare tokens/s.

    python benchmarks/bench_data.py [--seq_len 2048] [--local_batch_size 8] [--dp_size 8]
                                    [--workers 2] [--cache_dir DIR]

Uses the embedded stdlib default (no download): its tokenizer and store are built in
--cache_dir (a temp dir by default, so the first-use build time is printed too). Goals on the
2-core dev machine: loader >= 5M tok/s per rank, prepare >= 1M tok/s with 2 workers.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data import DataConfig, build_dataloader  # noqa: E402
from trainer.data.cache import ensure_stdlib  # noqa: E402
from trainer.data.prepare import prepare_store  # noqa: E402


def bench_loader(cfg: DataConfig, args) -> float:
    """Tokens/s of next_microbatch on one rank (the last of dp_size) for ~args.seconds."""
    loader = build_dataloader(cfg, seq_len=args.seq_len, local_batch_size=args.local_batch_size,
                              global_batch_size=args.local_batch_size * args.dp_size,
                              dp_rank=args.dp_size - 1, dp_size=args.dp_size, seed=0)
    print(f"loader: {loader.describe()}")
    for _ in range(20):  # warm the page cache and the code paths
        loader.next_microbatch()
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        x, _ = loader.next_microbatch()
        tokens += x.numel()
    return tokens / (time.perf_counter() - start)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the prepare workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_prepare(cfg: DataConfig, tokenizer: str, out: str, workers: int):
    """Tokens/s of a fresh `prepare` of the stdlib corpus, worker start-up included, and
    tokens per CPU-second (independent of other load on the machine)."""
    start, cpu = time.perf_counter(), cpu_seconds()
    manifest = prepare_store(cfg, tokenizer, out, workers=workers, show_progress=False)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return manifest["total_tokens"] / wall, manifest["total_tokens"] / cpu, manifest["total_tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--local_batch_size", type=int, default=8)
    p.add_argument("--dp_size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--cache_dir", default="")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DataConfig(cache_dir=args.cache_dir or os.path.join(tmp, "cache"))
        start = time.perf_counter()
        tokenizer, _ = ensure_stdlib(cfg, workers=args.workers, show_progress=False)
        print(f"stdlib tokenizer + store ready (first use, if not cached) in "
              f"{time.perf_counter() - start:.1f}s")
        rate, per_cpu, total = bench_prepare(replace(cfg, store_path=""), tokenizer,
                                             os.path.join(tmp, "store"), args.workers)
        print(f"prepare: {total:,} tokens with {args.workers} workers: {rate / 1e6:.2f}M tok/s "
              f"(goal >= 1M); {per_cpu / 1e6:.2f}M tok per CPU-second; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        rate = bench_loader(cfg, args)
        print(f"loader: {rate / 1e6:.1f}M tok/s per rank (seq_len {args.seq_len}, local batch "
              f"{args.local_batch_size}, dp rank {args.dp_size - 1}/{args.dp_size}; goal >= 5M)")


if __name__ == "__main__":
    main()
