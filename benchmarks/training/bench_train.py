"""Train a config for N steps on whatever device is here and report what it achieved.

    python benchmarks/training/bench_train.py --config configs/debug_model.toml --ngpu 1
        --steps 30 \
        [--warmup 5] [--repeats 3] [--label name] -- --training.seq_len 4096 ...

Prints tokens/s per device, MFU (when the trainer knows the device's peak), peak memory, the
step-time spread (median, p10, p90 after the warm-up steps), and the memory plan's peak next
to the measured one (on CUDA: the allocator's peak active bytes, i.e. max_memory_allocated);
appends a JSON line to benchmarks/results.jsonl.

It runs the product through run_train.sh, not an in-process copy of the loop: the figure is
then what a user gets (launcher, config, FSDP, data loader, metrics), and the per-step
figures are the trainer's own TensorBoard scalars (`--metrics.log_freq 1`). Logging every step
adds one loss all-reduce and a host sync per step: a few ms, noticeable only for very short
steps. Checkpointing is off unless the overrides turn it on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, run_train, spread, tb_scalars
from trainer.config.job import load_config
from trainer.plan.memory import memory_plan

GIB = 2**30
LOSS = "loss_metrics/global_avg_loss"
SAID = ("SDPA kernel:", "memory: step")  # the run's own lines worth repeating
MEMORY_TAGS = ("memory/max_active(GiB)", "memory/max_reserved(GiB)", "memory/max_rss(GiB)")


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--config", default=str(REPO / "configs" / "debug_model.toml"))
    ap.add_argument("--ngpu", type=int, default=0, help="ranks; default: GPUs, else 2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the figures")
    ap.add_argument("--repeats", type=int, default=1, help="runs; figures are their median")
    ap.add_argument("--label", default="", help="a name for the record (e.g. 'compile')")
    ap.add_argument("--no-record", action="store_true", help="do not append to results.jsonl")
    ap.add_argument("overrides", nargs=argparse.REMAINDER, help="-- then config overrides")
    args = ap.parse_args(argv)
    args.overrides = (
        [a for a in args.overrides if a != "--"] if args.overrides[:1] == ["--"] else args.overrides
    )
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if not args.ngpu:
        import torch

        args.ngpu = torch.cuda.device_count() or 2
    return args


def one_run(args) -> dict:
    """Run once; per-step figures after the warm-up, and the run's effective config."""
    with tempfile.TemporaryDirectory(prefix="bench_train_") as dump:
        fixed = [
            "--training.steps",
            str(args.steps),
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "true",
            "--checkpoint.enable",
            "false",
        ]
        proc, wall = run_train(dump, fixed + args.overrides, ngpu=args.ngpu, config=args.config)

        def kept(tag, dump=dump):
            return [v for s, v in sorted(tb_scalars(dump, tag).items()) if s > args.warmup]

        run = {
            "wall_s": wall,
            "step_s": kept("time_metrics/end_to_end(s)"),
            "tps": kept("throughput(tps)"),
            "mfu": kept("mfu(%)"),
            "memory": {t: max(kept(t)) for t in MEMORY_TAGS if kept(t)},
            "losses": [v for _, v in sorted(tb_scalars(dump, LOSS).items())],
            "said": [line for line in proc.stdout.splitlines() if line.startswith(SAID)],
        }
        run["cfg"] = load_config(["--job.config_file", os.path.join(dump, "config.toml")])
    return run


def summarise(args, runs: list[dict]) -> dict:
    """The median over runs of each run's median (one run: its own figures)."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    step_all = [s for r in runs for s in r["step_s"]]
    plan = memory_plan(runs[0]["cfg"], args.ngpu)
    out = {
        "tokens_per_s_per_device": med([med(r["tps"]) for r in runs]),
        "mfu_pct": med([med(r["mfu"]) for r in runs if r["mfu"]]),
        "step_time_s": spread(step_all),
        "run_median_step_s": [med(r["step_s"]) for r in runs],
        "peak_memory_gib": {
            t.split("/")[1]: max(r["memory"][t] for r in runs)
            for t in MEMORY_TAGS
            if t in runs[0]["memory"]
        },
        "plan_peak_gib": plan["total"] / GIB,
    }
    active = out["peak_memory_gib"].get("max_active(GiB)")
    if active:
        out["plan_error_pct"] = 100 * (out["plan_peak_gib"] / active - 1)
    return out


def print_summary(args, s: dict) -> None:
    st = s["step_time_s"]
    print(f"config: {args.config} {' '.join(args.overrides)}")
    print(
        f"ranks: {args.ngpu}; steps: {args.steps} (first {args.warmup} left out) x "
        f"{args.repeats} run(s)"
    )
    print(f"tokens/s per device: {s['tokens_per_s_per_device']:,.1f}")
    print(
        f"MFU: {s['mfu_pct']:.2f}%"
        if s["mfu_pct"] is not None
        else "MFU: not reported (no known peak for this device; set --metrics.peak_tflops)"
    )
    print(
        f"step time: median {st['median']:.4f} s, p10 {st['p10']:.4f} s, p90 {st['p90']:.4f} s "
        f"(min {st['min']:.4f}, max {st['max']:.4f}, n={st['n']})"
    )
    for tag, gib in s["peak_memory_gib"].items():
        print(f"peak memory (rank 0): {tag} = {gib:.3f} GiB")
    line = f"memory plan peak: {s['plan_peak_gib']:.3f} GiB"
    if "plan_error_pct" in s:
        line += (
            f" vs measured max_active {s['peak_memory_gib']['max_active(GiB)']:.3f} GiB: "
            f"plan error {s['plan_error_pct']:+.1f}%"
        )
    else:
        line += " (CPU: peak RSS also holds the interpreter and libraries; compare on a GPU)"
    print(line)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    runs = []
    for i in range(args.repeats):
        runs.append(one_run(args))
        for line in runs[-1]["said"]:
            print(f"run {i + 1}/{args.repeats} said: {line}")
        print(
            f"run {i + 1}/{args.repeats} losses: "
            + " ".join(f"{v:.4f}" for v in runs[-1]["losses"])
        )
        print(
            f"run {i + 1}/{args.repeats}: median step "
            f"{statistics.median(runs[-1]['step_s']):.4f} s, wall {runs[-1]['wall_s']:.1f} s",
            flush=True,
        )
    summary = summarise(args, runs)
    print_summary(args, summary)
    if not args.no_record:
        append_result(
            {
                "bench": "train",
                "label": args.label,
                "config": os.path.relpath(args.config, REPO),
                "overrides": args.overrides,
                "ngpu": args.ngpu,
                "steps": args.steps,
                "warmup": args.warmup,
                "repeats": args.repeats,
                **summary,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
