"""float32 vs bfloat16 on this machine's CPU: what `mixed_precision_param = "auto"` decides.

    python benchmarks/training/bench_dtype.py [--size 1024] [--repeats 5] [--steps 3]

1. A square matmul in each dtype (median GFLOP/s of `--repeats` timings, interleaved).
2. The default debug run (`./run_train.sh`, 2 CPU ranks) for `--steps` steps in each dtype:
   median step time of the steps after the first, as the console reports it.
It prints the CPU's bf16 capability as the trainer detects it and the dtype "auto" picks, so
a slow default shows up here before it shows up as a 35-minute quick start.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, run_train
from trainer.device import cpu_native_bf16, resolve_compute_dtype


def matmul_gflops(size: int, dtype: torch.dtype, repeats: int) -> list[float]:
    a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        out.append(2 * size**3 / (time.perf_counter() - t0) / 1e9)
    return out


def debug_run_step_s(dtype: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as dump:
        proc, _ = run_train(
            dump,
            [
                "--training.device",
                "cpu",
                "--training.steps",
                str(steps),
                "--metrics.log_freq",
                "1",
                "--checkpoint.enable",
                "false",
                "--training.mixed_precision_param",
                dtype,
            ],
            ngpu=2,
            config=str(REPO / "configs" / "debug_model.toml"),
        )
    times = [float(t) for t in re.findall(r"time: ([\d.]+)s/step", proc.stdout)]
    return statistics.median(times[1:] or times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    native, isa = cpu_native_bf16()
    auto = resolve_compute_dtype("auto", "float32", torch.device("cpu"))
    print(
        f"cpu: {torch.backends.cpu.get_cpu_capability()}; native bf16: {native} ({isa}); "
        f"auto picks {auto.param}; intra-op threads {torch.get_num_threads()}"
    )
    fp32, bf16 = [], []
    for _ in range(a.repeats):  # interleaved, so a busy moment hits both
        fp32 += matmul_gflops(a.size, torch.float32, 1)
        bf16 += matmul_gflops(a.size, torch.bfloat16, 1)
    g32, g16 = statistics.median(fp32), statistics.median(bf16)
    print(
        f"matmul {a.size}^3: float32 {g32:.2f} GFLOP/s, bfloat16 {g16:.2f} GFLOP/s "
        f"(bf16 is {g32 / g16:.1f}x slower)"
        if g16 < g32
        else f"matmul {a.size}^3: float32 {g32:.2f} GFLOP/s, bfloat16 {g16:.2f} GFLOP/s "
        f"(bf16 is {g16 / g32:.1f}x faster)"
    )
    s32, s16 = debug_run_step_s("float32", a.steps), debug_run_step_s("bfloat16", a.steps)
    print(
        f"debug run, 2 CPU ranks: float32 {s32:.3f} s/step, bfloat16 {s16:.3f} s/step; "
        f"100 steps: ~{100 * s32 / 60:.1f} min vs ~{100 * s16 / 60:.1f} min"
    )
    append_result(
        {
            "bench": "dtype",
            "native_bf16": native,
            "isa": isa,
            "auto": auto.param,
            "matmul_gflops_fp32": g32,
            "matmul_gflops_bf16": g16,
            "debug_step_s_fp32": s32,
            "debug_step_s_bf16": s16,
        }
    )


if __name__ == "__main__":
    main()
