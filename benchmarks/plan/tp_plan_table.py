"""When tensor parallelism pays off: the memory plan and per-step communication of FSDP-only
against TP 2/4/8 x FSDP, for Llama 8B and 70B on 8 to 128 H100s (nodes of 8). Prints the
Markdown table of docs/parallelism.md's section "When tensor parallelism pays off".

    python benchmarks/plan/tp_plan_table.py [--gpus 8 16 32 64 128] [--tp 1 2 4 8] [--mfu 0.4]

Every layout keeps the config's global batch and 1 x seq_len tokens per GPU per microbatch
(local_batch_size = tp sequences per dp rank), so the microbatches per step are the same and
only the layout differs. All figures come from trainer.plan.memory (memory) and trainer.plan.comm
(bytes each rank sends per optimizer step); "GB/s at 40% MFU" divides a dimension's bytes by
the step time at that MFU: the bandwidth that dimension needs for communication not to slow
the step (tp is innermost, so with tp <= 8 it is NVLink inside a node; dp_shard crosses
nodes whenever tp x dp_shard > 8).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.config.job import load_config  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402
from trainer.models.flops import table_peak_tflops  # noqa: E402
from trainer.plan.comm import comm_volume  # noqa: E402
from trainer.plan.memory import (
    GIB,
    GPUS,
    device_need,
    largest_local_batch,
    memory_plan,  # noqa: E402
    throughput,
)

REPO = Path(__file__).resolve().parents[2]
MODELS = {"8B": "configs/llama3_8b.toml", "70B": "configs/llama3_70b.toml"}


def layout(config: str, tp: int):
    """The config with tensor_parallel_degree = tp and its per-GPU microbatch (local batch /
    its own tp) times tp sequences per dp rank."""
    base = load_config(["--job.config_file", str(REPO / config)])
    per_gpu = max(1, base.training.local_batch_size // base.parallelism.tensor_parallel_degree)
    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / config),
            "--parallelism.tensor_parallel_degree",
            str(tp),
            "--training.local_batch_size",
            str(per_gpu * tp),
        ]
    )
    return cfg


def row(name: str, config: str, world: int, tp: int, gpu, mfu: float) -> str:
    cfg = layout(config, tp)
    label = "FSDP" if tp == 1 else f"TP {tp} x FSDP"
    try:
        pd, accum = cfg.resolve(world)
        b, c = memory_plan(cfg, world), comm_volume(cfg, world)
    except ConfigError as e:
        return f"| {name} | {world} | {label} | - | - | - | - | - | - | - | {e.one_line()[:60]} |"
    need = device_need(b["total"]) / GIB
    fits = "fits" if need <= gpu.memory_gib else "**no**"
    best = largest_local_batch(cfg, world, gpu.memory_gib)
    _, tps = throughput(cfg, table_peak_tflops(gpu.name)[0], mfu)
    t = cfg.training
    step_s = t.local_batch_size * t.seq_len * accum / (tps * tp)
    bw = lambda v: f"{v / step_s / 1e9:.0f}"  # noqa: E731  GB/s
    mesh = f"{pd.dp_shard}" + (f" x tp {tp}" if tp > 1 else "")
    return (
        f"| {name} | {world} | {label} | {mesh} | {need:.1f} {fits} | {best} | {accum} | "
        f"{c['comm_tp'] / GIB:.0f} | {c['comm_dp_shard'] / GIB:.0f} | "
        f"{bw(c['comm_tp'])} / {bw(c['comm_dp_shard'])} | {step_s:.1f} |"
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--mfu", type=float, default=0.40)
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    args = ap.parse_args(argv)
    gpu = GPUS[args.gpu]
    print(
        f"| model | GPUs | layout | dp_shard (x tp) | GiB/GPU ({gpu.memory_gib:.1f}) | "
        "max local batch (seqs per dp rank) | microbatches | tp GiB/step | dp_shard GiB/step | "
        f"GB/s tp / dp_shard at {args.mfu:.0%} MFU | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, config in MODELS.items():
        for world in args.gpus:
            for tp in args.tp:
                print(row(name, config, world, tp, gpu, args.mfu))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
