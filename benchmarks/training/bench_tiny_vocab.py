"""CPU seconds per rank and step of the tests' tiny model at two vocab sizes.

    python benchmarks/training/bench_tiny_vocab.py [--ngpu 1 4] [--vocab 8192 1024] [--repeats 2]

At dim 64 the embedding and the output projection are most of `debugmodel-tiny` (2 x vocab x
64 weights against ~100k in its two blocks), so the vocab of its synthetic data sets most of a
step's work, all-gathers and saves. Each (ranks, vocab) runs run_train.sh twice, for
`--short` and `--long` steps (CPU ranks, fp32, synthetic data, no checkpoint), and the
difference of the two runs' CPU seconds (the whole process tree: launcher and ranks, as
getrusage(RUSAGE_CHILDREN) counts waited-for descendants) over the steps between them is one
figure: the launch's start cancels out. The vocabs alternate within each repeat, so a slow
spell of the machine falls on both; the median over the repeats is printed beside the first
vocab's (the baseline: data.vocab_size's default).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, run_train  # noqa: E402

TINY = [
    "--training.device",
    "cpu",
    "--model.flavor",
    "debugmodel-tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--data.dataset",
    "synthetic",
    "--checkpoint.enable",
    "false",
]


def children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def launch_cpu(ngpu: int, vocab: int, steps: int) -> float:
    """CPU seconds of one run_train.sh launch (its process tree)."""
    with tempfile.TemporaryDirectory() as dump:
        before = children_cpu()
        run_train(
            dump,
            [*TINY, "--data.vocab_size", str(vocab), "--training.steps", str(steps)],
            ngpu=ngpu,
            config=str(REPO / "configs" / "debug_model.toml"),
        )
        return children_cpu() - before


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ngpu", type=int, nargs="+", default=[1, 4], help="CPU rank counts")
    p.add_argument(
        "--vocab",
        type=int,
        nargs="+",
        default=[8192, 1024],
        help="data.vocab_size values; the first is the baseline",
    )
    p.add_argument("--short", type=int, default=5)
    p.add_argument("--long", type=int, default=55)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    span = args.long - args.short
    rows = []
    for ngpu in args.ngpu:
        per = {v: [] for v in args.vocab}  # CPU ms per rank and step, one per repeat
        for _ in range(args.repeats):
            for vocab in args.vocab:
                extra = launch_cpu(ngpu, vocab, args.long) - launch_cpu(ngpu, vocab, args.short)
                per[vocab].append(1e3 * extra / (span * ngpu))
        base = statistics.median(per[args.vocab[0]])
        for vocab in args.vocab:
            ms = statistics.median(per[vocab])
            rows.append(
                {
                    "ngpu": ngpu,
                    "vocab": vocab,
                    "cpu_ms_per_rank_step": round(ms, 1),
                    "of_baseline": round(ms / base, 2),
                    "repeats": [round(x, 1) for x in per[vocab]],
                }
            )
            print(
                f"{ngpu} rank(s), vocab {vocab:>5}: {ms:6.1f} CPU-ms a rank-step "
                f"({ms / base:.2f}x vocab {args.vocab[0]}; repeats "
                f"{', '.join(f'{x:.1f}' for x in per[vocab])})",
                flush=True,
            )
    append_result({"bench": "tiny_vocab", "short": args.short, "long": args.long, "rows": rows})


if __name__ == "__main__":
    main()
