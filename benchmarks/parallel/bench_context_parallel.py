"""Context parallelism on CPU ranks: the step time of CP 2 against 1 rank at the same global
batch, and the activation memory per rank against cp, in one run.

    python benchmarks/parallel/bench_context_parallel.py [--steps 12] [--warmup 4] [--seq 2048]

1. Step time: run_train.sh with the debug model (fp32, synthetic tokens, 2 sequences per
   step) on 1 rank, then on 2 ranks with CP 2 (dp 1: both ranks hold halves of the same two
   sequences); the trainer's own per-step times (TensorBoard) after the warm-up.
2. Memory: the traced dry run (trainer/plan/trace.py: one real step on fake tensors, rank 0)
   of the debug model at 8 x the sequence length, at cp 1, 2, 4 and 8 (world = cp): the
   activations saved for backward per rank, traced and planned. Nothing is allocated.
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
from trainer.plan.memory import memory_plan
from trainer.plan.trace import trace_step

MIB = 2**20


def step_times(seq: int, steps: int, warmup: int, nproc: int, cp: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as dump:
        run_train(
            dump,
            [
                "--training.device",
                "cpu",
                "--model.flavor",
                "debugmodel",
                "--training.seq_len",
                str(seq),
                "--training.local_batch_size",
                "2",
                "--training.global_batch_size",
                "2",
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
                "--parallelism.context_parallel_degree",
                str(cp),
            ],
            ngpu=nproc,
            config=str(REPO / "configs" / "debug_model.toml"),
        )
        times = tb_scalars(dump, "time_metrics/end_to_end(s)")
    return [v for s, v in sorted(times.items()) if s > warmup]


def traced_activations(seq: int, cp: int) -> tuple[float, float, float]:
    """(traced activations, planned activations, traced peak) per rank, MiB."""
    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "configs" / "debug_model.toml"),
            "--training.seq_len",
            str(seq),
            "--training.local_batch_size",
            "1",
            "--training.global_batch_size",
            "1",
            "--training.device",
            "cpu",
            "--training.mixed_precision_param",
            "bfloat16",
            "--data.dataset",
            "synthetic",
            "--parallelism.context_parallel_degree",
            str(cp),
        ]
    )
    r = trace_step(cfg, cp)
    plan = memory_plan(cfg, cp)
    return (r.categories["activations"] / MIB, plan["activations"] / MIB, r.peak / MIB)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args(argv)
    one = step_times(args.seq, args.steps, args.warmup, nproc=1, cp=1)
    two = step_times(args.seq, args.steps, args.warmup, nproc=2, cp=2)
    a, b = statistics.median(one), statistics.median(two)
    print(
        f"step time, debug model fp32, 2 x {args.seq} tokens per step (median after "
        f"{args.warmup} warm-up steps):"
    )
    print(
        f"  1 rank        {a:.3f} s   (p10-p90 {spread(one)['p10']:.3f}-{spread(one)['p90']:.3f})"
    )
    print(
        f"  CP 2, 2 ranks {b:.3f} s   (p10-p90 {spread(two)['p10']:.3f}-{spread(two)['p90']:.3f})"
        f"  = {a / b:.2f}x the 1-rank speed"
    )
    seq = 8 * args.seq
    print(f"activations per rank, debug model bf16, 1 x {seq} tokens (traced dry run, rank 0):")
    print(f"  {'cp':>3} {'traced MiB':>11} {'plan MiB':>9} {'traced peak MiB':>16}")
    rows = []
    for cp in (1, 2, 4, 8):
        act, plan, peak = traced_activations(seq, cp)
        rows.append(
            {
                "cp": cp,
                "traced_activations_mib": act,
                "plan_activations_mib": plan,
                "traced_peak_mib": peak,
            }
        )
        print(f"  {cp:>3} {act:>11.1f} {plan:>9.1f} {peak:>16.1f}")
    append_result(
        {
            "bench": "context_parallel",
            "seq": args.seq,
            "one_rank_step_s": a,
            "cp2_step_s": b,
            "memory": rows,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
