"""The longest sequence that fits an H100 at context-parallel degrees 1-16, by the memory plan
(trainer/plan/memory.py): Llama 3.1 8B on 16 GPUs (FSDP over dp_shard x cp = 16) and 70B on
128 GPUs (TP 8 x CP x dp_shard, dp_shard x cp = 16), full AC, one sequence per microbatch,
bf16, fused AdamW, block_causal (FlexAttention's block mask on CUDA).

    python benchmarks/plan/cp_table.py [--gpu h100]

Prints a Markdown table (the context-parallel table of docs/parallelism.md): for each cp, the
longest multiple of 8,192 tokens whose planned peak plus the reserve fits the GPU, the peak
there, and the K/V all-gather volume per step. Analytic: no tensor is allocated; under a minute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer.config.job import load_config  # noqa: E402
from trainer.plan.comm import comm_volume  # noqa: E402
from trainer.plan.memory import GIB, GPUS, device_need, memory_plan  # noqa: E402

STEP = 8192
SHAPES = [("llama3.1-8B", 16, 1), ("llama3.1-70B", 128, 8)]  # flavor, GPUs, tp


def config(flavor: str, world: int, tp: int, cp: int, seq: int):
    dp = world // (tp * cp)
    return load_config(
        [
            "--job.config_file",
            str(REPO / "configs" / "llama3_8b_128k.toml"),
            "--model.flavor",
            flavor,
            "--training.seq_len",
            str(seq),
            "--training.global_batch_size",
            str(dp),
            "--training.local_batch_size",
            "1",
            "--parallelism.tensor_parallel_degree",
            str(tp),
            "--parallelism.context_parallel_degree",
            str(cp),
        ]
    )


def longest(flavor: str, world: int, tp: int, cp: int, gpu_gib: float):
    """(seq, plan) for the longest multiple of STEP that fits, or (0, None): doubling, then
    bisection (the plan grows with seq)."""

    def fits(k: int):
        b = memory_plan(config(flavor, world, tp, cp, k * STEP), world)
        return b if device_need(b["total"]) <= gpu_gib * GIB else None

    lo, hi = 0, 1
    while hi <= 1024 and fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return (lo * STEP, fits(lo)) if lo else (0, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    args = ap.parse_args()
    gpu = GPUS[args.gpu]
    print(
        f"| model | GPUs | layout | longest sequence (tokens) | planned peak GiB | with reserve "
        f"GiB ({args.gpu} {gpu.memory_gib:.0f} GiB) | K/V all-gather per step, GiB per rank |"
    )
    print("|---|---|---|---|---|---|---|")
    for flavor, world, tp in SHAPES:
        for cp in (1, 2, 4, 8, 16):
            seq, b = longest(flavor, world, tp, cp, gpu.memory_gib)
            dp_shard = world // (tp * cp)
            layout = f"{'TP ' + str(tp) + ' x ' if tp > 1 else ''}CP {cp} x FSDP {dp_shard}"
            if not seq:
                print(f"| {flavor} | {world} | {layout} | none fits | | | |")
                continue
            comm = comm_volume(config(flavor, world, tp, cp, seq), world)["comm_cp"]
            print(
                f"| {flavor} | {world} | {layout} | {seq:,} ({seq // 1024}k) | "
                f"{b['total'] / GIB:.1f} | {device_need(b['total']) / GIB:.1f} | "
                f"{comm / GIB:.1f} |"
            )


if __name__ == "__main__":
    main()
