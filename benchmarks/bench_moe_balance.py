"""Aux-loss-free load balancing over 200 steps: the experts' max / mean load with
`moe.load_balance_coeff` on (the default, 1e-3) beside the same run with it off, in one run.

    python benchmarks/bench_moe_balance.py [--steps 200] [--ngpu 2] [--ep 2]

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
import tempfile

from common import REPO, append_result, run_train, tb_scalars

LAYERS = (1, 2, 3)  # debugmodel-moe: layer 0 is dense


def run(dump: str, steps: int, ngpu: int, ep: int, coeff: float) -> dict[str, float]:
    run_train(dump, ["--training.device", "cpu", "--training.steps", str(steps),
                     "--training.mixed_precision_param", "float32",
                     "--checkpoint.enable", "false", "--metrics.log_freq", "1",
                     "--parallelism.expert_parallel_degree", str(ep),
                     "--moe.load_balance_coeff", str(coeff)],
              ngpu=ngpu, config=str(REPO / "configs" / "debug_moe.toml"))
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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        on = run(f"{tmp}/on", args.steps, args.ngpu, args.ep, 1e-3)
        off = run(f"{tmp}/off", args.steps, args.ngpu, args.ep, 0.0)
    print(f"debugmodel-moe, {args.steps} steps on {args.ngpu} CPU ranks, EP {args.ep}: "
          "max / mean expert load (1.0 = balanced)")
    print(f"{'':22} {'coeff 1e-3 (on)':>16} {'coeff 0 (off)':>14}")
    for key in [f"layer_{i}_last50" for i in LAYERS] + ["mean_first10", "mean_last50",
                                                         "loss_last10"]:
        print(f"{key:22} {on[key]:16.3f} {off[key]:14.3f}")
    append_result({"bench": "moe_balance", "steps": args.steps, "ngpu": args.ngpu,
                   "ep": args.ep, "on": on, "off": off})


if __name__ == "__main__":
    main()
