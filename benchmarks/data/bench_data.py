"""Data pipeline throughput: loader tokens/s per rank from a token store, and prepare tokens/s.

    python benchmarks/data/bench_data.py [--seq_len 2048] [--local_batch_size 8] [--dp_size 8]
                                    [--workers 2] [--cache_dir DIR]

Uses the embedded stdlib default (no download): its tokenizer and store are built in
--cache_dir (a temp dir by default, so the first-use build time is printed too). Goals on the
2-core dev machine: loader >= 5M tok/s per rank, prepare >= 1M tok/s with 2 workers.

Then a blend against a single store, side by side in this process: a 3-source `data.mix`
(weights 0.5 / 0.3 / 0.2; the three sources are the stdlib store under three names, so every
source is as large as the single store and only the blending differs) and the single store,
timed in alternating slices; the figure is the median of the per-round ratios (goal >= 0.9x).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.data import DataConfig, build_dataloader  # noqa: E402
from trainer.data.cache import ensure_stdlib  # noqa: E402
from trainer.data.prepare import prepare_store  # noqa: E402


def bench_loader(cfg: DataConfig, args) -> float:
    """Tokens/s of next_microbatch on one rank (the last of dp_size) for ~args.seconds."""
    loader = build_dataloader(
        cfg,
        seq_len=args.seq_len,
        local_batch_size=args.local_batch_size,
        global_batch_size=args.local_batch_size * args.dp_size,
        dp_rank=args.dp_size - 1,
        dp_size=args.dp_size,
        seed=0,
    )
    print(f"loader: {loader.describe()}")
    for _ in range(20):  # warm the page cache and the code paths
        loader.next_microbatch()
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        x, _ = loader.next_microbatch()
        tokens += x.numel()
    return tokens / (time.perf_counter() - start)


def timed_slice(loader, seconds: float) -> float:
    """Tokens/s of next_microbatch over one slice of `seconds`."""
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x, _ = loader.next_microbatch()
        tokens += x.numel()
    return tokens / (time.perf_counter() - start)


def bench_blend(cfg: DataConfig, store: str, args) -> tuple[float, float, float]:
    """(single tok/s, blend tok/s, median blend/single ratio) over alternating slices."""
    from trainer.data.config import MixSource

    blend_cfg = replace(
        cfg,
        mix=[
            MixSource(name=n, store_path=store, weight=w)
            for n, w in (("web", 0.5), ("code", 0.3), ("math", 0.2))
        ],
    )
    kw = dict(
        seq_len=args.seq_len,
        local_batch_size=args.local_batch_size,
        global_batch_size=args.local_batch_size * args.dp_size,
        dp_rank=args.dp_size - 1,
        dp_size=args.dp_size,
        seed=0,
    )
    single = build_dataloader(replace(cfg, store_path=store), **kw)
    blend = build_dataloader(blend_cfg, **kw)
    for loader in (single, blend):
        for _ in range(20):
            loader.next_microbatch()
    singles, blends, ratios = [], [], []
    for _ in range(args.rounds):
        a, b = timed_slice(single, args.slice), timed_slice(blend, args.slice)
        singles.append(a)
        blends.append(b)
        ratios.append(b / a)
    return statistics.median(singles), statistics.median(blends), statistics.median(ratios)


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
    p.add_argument("--rounds", type=int, default=12, help="alternating slices per loader")
    p.add_argument("--slice", type=float, default=0.5, help="seconds per slice")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DataConfig(cache_dir=args.cache_dir or os.path.join(tmp, "cache"))
        start = time.perf_counter()
        tokenizer, _ = ensure_stdlib(cfg, workers=args.workers, show_progress=False)
        print(
            f"stdlib tokenizer + store ready (first use, if not cached) in "
            f"{time.perf_counter() - start:.1f}s"
        )
        rate, per_cpu, total = bench_prepare(
            replace(cfg, store_path=""), tokenizer, os.path.join(tmp, "store"), args.workers
        )
        print(
            f"prepare: {total:,} tokens with {args.workers} workers: {rate / 1e6:.2f}M tok/s "
            f"(goal >= 1M); {per_cpu / 1e6:.2f}M tok per CPU-second; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        rate = bench_loader(cfg, args)
        print(
            f"loader: {rate / 1e6:.1f}M tok/s per rank (seq_len {args.seq_len}, local batch "
            f"{args.local_batch_size}, dp rank {args.dp_size - 1}/{args.dp_size}; goal >= 5M)"
        )
        _, store = ensure_stdlib(cfg, show_progress=False)
        single, blend, ratio = bench_blend(cfg, store, args)
        print(
            f"blend of 3 sources vs one store, {args.rounds} alternating rounds of "
            f"{args.slice}s: single {single / 1e6:.2f}M tok/s, blend {blend / 1e6:.2f}M tok/s "
            f"per rank: {ratio:.3f}x (median of per-round ratios; goal >= 0.9x)"
        )


if __name__ == "__main__":
    main()
