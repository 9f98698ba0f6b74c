"""float8 experts against bf16 over a training run, on one GPU (the bar: loss within 1e-2 of bf16
over 50 steps):

    python benchmarks/gpu/float8_moe_train.py [--steps 50] [--flavor debugmodel-moe]

Runs run_train.sh twice on the debug MoE config (bf16, compile off, the same seed and data):
once as is, once with `float8.moe = true`; prints both loss curves' every tenth step, the
largest and the mean absolute difference over the run, and each run's tokens/s. Off CUDA it
runs `float8.moe_emulate` (numerics only) at float32.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(dump: Path, args, extra: list[str]) -> tuple[dict[int, float], list[float]]:
    env = {
        **os.environ,
        "NGPU": "1",
        "CONFIG_FILE": "configs/debug_moe.toml",
        "PYTHON": sys.executable,
    }
    cmd = [
        str(REPO / "run_train.sh"),
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(args.steps),
        "--model.flavor",
        args.flavor,
        "--checkpoint.enable",
        "false",
        "--parallelism.expert_parallel_degree",
        "1",
        "--metrics.log_freq",
        "1",
        *extra,
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(
            f"{' '.join(extra) or 'baseline'} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(dump.rglob("events.out.tfevents*")).parent))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("loss_metrics/global_avg_loss")}
    tps = [e.value for e in events.Scalars("throughput(tps)")]
    return losses, tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--flavor", default="debugmodel-moe")
    args = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    dtype = ["--training.mixed_precision_param", "bfloat16" if cuda else "float32"]
    f8 = ["--float8.moe", "true"] + ([] if cuda else ["--float8.moe_emulate", "true"])
    with tempfile.TemporaryDirectory() as tmp:
        base, tb = run(Path(tmp) / "bf16", args, dtype)
        quant, tq = run(Path(tmp) / "f8", args, dtype + f8)
    steps = sorted(set(base) & set(quant))
    diffs = [abs(base[s] - quant[s]) for s in steps]
    for s in steps[::10] + steps[-1:]:
        print(f"step {s:4d}: {dtype[1]} {base[s]:.4f}  float8 experts {quant[s]:.4f}")
    print(
        f"float8 experts vs {dtype[1]} over {len(steps)} steps: max |diff| {max(diffs):.4f}, "
        f"mean {sum(diffs) / len(diffs):.4f}{'' if cuda else ' (emulated on the CPU)'}"
    )
    if tb and tq:
        half = len(tb) // 2
        print(
            f"tokens/s (median of the second half): {dtype[1]} "
            f"{sorted(tb[half:])[len(tb[half:]) // 2]:.0f}, "
            f"float8 experts {sorted(tq[half:])[len(tq[half:]) // 2]:.0f}"
        )


if __name__ == "__main__":
    main()
