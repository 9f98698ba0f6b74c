"""The traced peak per rank at the real shapes, beside the analytic plan's (trainer/plan/):
1B, 8B, 70B and 405B at their configs' intended world sizes, 70B at 64-512 and 8B from 8 to
1,024 ranks. Each row is one real training step on fake tensors (trainer/plan/trace.py), in
this one CPU process; nothing is allocated.

    python benchmarks/plan/scale_table.py [--quick]     # --quick: the four intended sizes only

Prints a Markdown table (the "At scale" table of docs/plan.md) and how long each trace took.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer.config.job import load_config  # noqa: E402
from trainer.plan.memory import GIB, GPUS, device_need, memory_plan  # noqa: E402
from trainer.plan.trace import trace_step  # noqa: E402

INTENDED = [
    ("llama3_1b.toml", 8),
    ("llama3_8b.toml", 64),
    ("llama3_70b.toml", 64),
    ("llama3_405b.toml", 512),
]
# The trace cannot run pipeline schedules: 405B's row is its layout without pp (TP 8 x FSDP 64,
# 8 sequences per dp rank); `python -m trainer.plan` gives the shipped PP 8 layout per pp rank.
WITHOUT_PP = ["--parallelism.pipeline_parallel_degree", "1", "--training.local_batch_size", "8"]
SWEEPS = [("llama3_70b.toml", w) for w in (128, 512)] + [
    ("llama3_8b.toml", w) for w in (8, 16, 32, 128, 256, 512, 1024)
]


def row(config: str, world: int, gpu_gib: float) -> str:
    overrides = ["--job.config_file", str(REPO / "configs" / config)]
    if load_config(overrides).parallelism.pipeline_parallel_degree > 1:
        overrides += WITHOUT_PP
    cfg = load_config(overrides)
    if cfg.training.global_batch_size != -1:  # at least one sequence per dp rank
        dp = world // cfg.parallelism.tensor_parallel_degree
        batch = max(cfg.training.global_batch_size, dp * cfg.training.local_batch_size)
        cfg = load_config([*overrides, "--training.global_batch_size", str(batch)])
    pd, accum = cfg.resolve(world)
    plan = memory_plan(cfg, world)["total"]
    r = trace_step(cfg, world)
    need = device_need(r.peak)
    return (
        f"| {cfg.model.flavor} | {world} | {pd.describe()} | {cfg.training.local_batch_size}"
        f" x {cfg.training.seq_len}, {accum} | {cfg.activation_checkpoint.mode} | "
        f"{r.peak / GIB:.1f} | {plan / GIB:.1f} | {plan / r.peak - 1:+.1%} | "
        f"{need / GIB:.1f} ({'fits' if need <= gpu_gib * GIB else 'does not fit'}) | "
        f"{r.seconds:.0f} s |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the intended world sizes only")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    args = ap.parse_args()
    gpu = GPUS[args.gpu]
    print(
        f"| model | GPUs | mesh | microbatch (seqs x tokens), microbatches | AC | traced "
        f"peak GiB | plan GiB | plan vs trace | with reserve GiB, {args.gpu} "
        f"{gpu.memory_gib:.0f} GiB | trace time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    t0 = time.monotonic()
    for config, world in INTENDED + ([] if args.quick else SWEEPS):
        print(row(config, world, gpu.memory_gib), flush=True)
    print(
        f"\n{time.monotonic() - t0:.0f} s in all (torch {__import__('torch').__version__}, "
        "one CPU process)"
    )


if __name__ == "__main__":
    main()
