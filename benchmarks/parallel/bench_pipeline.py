"""Pipeline schedules on 4 CPU ranks: each schedule's measured step time beside its ideal
bubble fraction, and the data-parallel baseline, in one run.

    python benchmarks/parallel/bench_pipeline.py [--steps 10] [--warmup 3] [--batch 8]

run_train.sh with the debug model (6 layers, fp32, synthetic tokens, seq 256) on 4 ranks: FSDP 4
(no pipeline; each rank runs every layer on a quarter of the batch) as the baseline, then PP 4
with every schedule torch offers (one rank per stage group; `--batch` pipeline microbatches of
one sample per schedule step, the same samples per optimizer step as the baseline). The
trainer's own per-step times (TensorBoard) after the warm-up. The bubble column is the ideal
model's (trainer/parallel/pp_layout.py `bubble_fraction`: equal stages, free p2p); the
"efficiency" column is the baseline's step time / the schedule's: 1.0 would be a pipeline with
no bubble and free communication. On CPU, gloo's p2p copies and 2 cores shared by 4 processes
weigh more than on GPUs, where PP pays off across nodes (docs/parallelism.md: pipeline parallelism).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, run_train, spread, tb_scalars
from trainer.config.job import load_config
from trainer.parallel.pp_layout import SCHEDULES, bubble_fraction, check_pipeline

SCHEDULE_NAMES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]


def overrides(batch: int, steps: int, pp: int, schedule: str | None) -> list[str]:
    args = [
        "--training.device",
        "cpu",
        "--model.flavor",
        "debugmodel",
        "--training.seq_len",
        "256",
        "--training.global_batch_size",
        str(batch),
        "--training.mixed_precision_param",
        "float32",
        "--data.dataset",
        "synthetic",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "true",
        "--checkpoint.enable",
        "false",
    ]
    if pp == 1:
        return args + ["--training.local_batch_size", str(batch // 4)]
    return args + [
        "--training.local_batch_size",
        str(batch),
        "--parallelism.pipeline_parallel_degree",
        str(pp),
        "--parallelism.pipeline_parallel_schedule",
        schedule,
    ]


def step_times(args: list[str], steps: int, warmup: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as dump:
        run_train(dump, args, ngpu=4, config=str(REPO / "configs" / "debug_model.toml"))
        times = tb_scalars(dump, "time_metrics/end_to_end(s)")
    return [v for s, v in sorted(times.items()) if s > warmup]


def ideal_bubble(batch: int, schedule: str) -> tuple[float, int]:
    cfg = load_config(overrides(batch, 1, 4, schedule))
    specs = check_pipeline(cfg.parallelism, cfg.training, 6, False, "debugmodel")
    return bubble_fraction(SCHEDULES[schedule], 4, batch, len(specs) // 4), len(specs)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="samples per step (= microbatches)")
    args = ap.parse_args(argv)
    base = step_times(overrides(args.batch, args.steps, 1, None), args.steps, args.warmup)
    b = statistics.median(base)
    print(
        f"debug model fp32, seq 256, {args.batch} samples per step, 4 CPU ranks; median step "
        f"time after {args.warmup} warm-up steps (p10-p90)"
    )
    print(
        f"  {'layout':<28} {'stages':>6} {'ideal bubble':>12} {'step s':>8} "
        f"{'p10-p90':>13} {'efficiency':>10}"
    )
    print(
        f"  {'FSDP 4 (baseline)':<28} {'-':>6} {'-':>12} {b:>8.3f} "
        f"{spread(base)['p10']:>6.3f}-{spread(base)['p90']:.3f} {1.0:>10.2f}"
    )
    rows = [{"layout": "fsdp4", "step_s": b}]
    for name in SCHEDULE_NAMES:
        bubble, stages = ideal_bubble(args.batch, name)
        times = step_times(overrides(args.batch, args.steps, 4, name), args.steps, args.warmup)
        t, s = statistics.median(times), spread(times)
        print(
            f"  {'PP 4 ' + name:<28} {stages:>6} {bubble:>12.1%} {t:>8.3f} "
            f"{s['p10']:>6.3f}-{s['p90']:.3f} {b / t:>10.2f}"
        )
        rows.append(
            {"layout": f"pp4_{name}", "stages": stages, "ideal_bubble": bubble, "step_s": t}
        )
    append_result({"bench": "pipeline", "batch": args.batch, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
