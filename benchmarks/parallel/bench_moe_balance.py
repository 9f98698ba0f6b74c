"""Aux-loss-free load balancing over 200 steps: the experts' max / mean load with
`moe.load_balance_coeff` on (the default, 1e-3, and 1e-2) beside the same run with it off (0),
in one run.

    python benchmarks/parallel/bench_moe_balance.py [--steps 200] [--ngpu 2] [--ep 2]
        [--coeffs 1e-3,1e-2,0]

`configs/debug_moe.toml` (debugmodel-moe: 3 MoE layers of 8 experts, top 2, on the stdlib
corpus; fp32 so the figure does not depend on the CPU) on `--ngpu` CPU ranks with expert
parallelism `--ep`, no checkpoints, every step logged. Prints, per MoE layer and averaged over
the layers, the load imbalance (max / mean tokens per expert over the whole batch, 1.0 =
perfect) over the first 10 steps, the last 50 steps, and the loss over the last 10 steps, on
and off. The same seed and data for both runs: the only difference is the bias.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, run_train, tb_scalars

LAYERS = (1, 2, 3)  # debugmodel-moe: layer 0 is dense


def run(dump: str, steps: int, ngpu: int, ep: int, coeff: float) -> dict[str, float]:
    run_train(
        dump,
        [
            "--training.device",
            "cpu",
            "--training.steps",
            str(steps),
            "--training.mixed_precision_param",
            "float32",
            "--checkpoint.enable",
            "false",
            "--metrics.log_freq",
            "1",
            "--parallelism.expert_parallel_degree",
            str(ep),
            "--moe.load_balance_coeff",
            str(coeff),
        ],
        ngpu=ngpu,
        config=str(REPO / "configs" / "debug_moe.toml"),
    )
    out = {}
    per_layer_first, per_layer_last = [], []
    for layer in LAYERS:
        values = tb_scalars(dump, f"moe/layer_{layer}/load_imbalance")
        ordered = [values[s] for s in sorted(values)]
        first, last = statistics.mean(ordered[:10]), statistics.mean(ordered[-50:])
        out[f"layer_{layer}_first10"], out[f"layer_{layer}_last50"] = first, last
        per_layer_first.append(first)
        per_layer_last.append(last)
    out["mean_first10"] = statistics.mean(per_layer_first)
    out["mean_last50"] = statistics.mean(per_layer_last)
    loss = tb_scalars(dump, "loss_metrics/global_avg_loss")
    out["loss_last10"] = statistics.mean(loss[s] for s in sorted(loss)[-10:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ngpu", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--coeffs", default="1e-3,1e-2,0")
    args = ap.parse_args()
    coeffs = [float(c) for c in args.coeffs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run(f"{tmp}/{i}", args.steps, args.ngpu, args.ep, c) for i, c in enumerate(coeffs)]
    print(
        f"debugmodel-moe, {args.steps} steps on {args.ngpu} CPU ranks, EP {args.ep}: "
        "max / mean expert load (1.0 = balanced)"
    )
    print(f"{'load_balance_coeff':22}" + "".join(f"{c:>12g}" for c in coeffs))
    for key in [f"layer_{i}_last50" for i in LAYERS] + [
        "mean_first10",
        "mean_last50",
        "loss_last10",
    ]:
        print(f"{key:22}" + "".join(f"{r[key]:12.3f}" for r in runs))
    append_result(
        {
            "bench": "moe_balance",
            "steps": args.steps,
            "ngpu": args.ngpu,
            "ep": args.ep,
            "runs": dict(zip(map(str, coeffs), runs, strict=True)),
        }
    )


if __name__ == "__main__":
    main()
