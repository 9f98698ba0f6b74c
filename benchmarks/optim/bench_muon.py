"""Muon against AdamW: the same model, data and token count, each at its best of three learning
rates; validation curves side by side, and the tokens Muon needs to reach AdamW's final loss.

    python benchmarks/optim/bench_muon.py [--steps 300] [--lrs 1e-3,3e-3,1e-2] [--ngpu 2] \
        [--png benchmarks/optim/muon_vs_adamw.png] [-- --model.flavor debugmodel ...]

Each run is the product (run_train.sh, configs/debug_model.toml on the stdlib corpus: the
debug model, seq 256, the shipped warmup-cosine schedule stretched to --steps) with
validation every --val-freq steps on the held-out split; only optimizer.name and optimizer.lr
change (Muon with `muon_lr_adjust = match_rms_adamw`, so both share one lr scale). The best
lr of each is the one with the lowest final validation loss. Prints every run's curve, the
two best side by side, the tokens at which Muon's validation loss first reaches AdamW's final
one (linear between validation points) and their ratio; writes the plot with matplotlib
(`pip install -e ".[bench]"`) when it is there. Then times the optimizer step alone, one
process, the same model: AdamW (fused) against Muon, and prints Muon's bytes per step and rank
at --ngpu ranks (trainer/optim/muon_dist.py: each rank sends its shard of the updates to their
owners and receives its shard of the results).

    python benchmarks/optim/bench_muon.py --ns [--experts 8] [--shape 96x64]

Only Newton-Schulz of a stack of same-shape expert matrices (trainer/optim/newton_schulz.py):
one batched bmm chain against a Python loop of one matrix at a time (torch.optim.Muon's way),
fp32 and bf16, the median of 10 on this machine, and the largest difference between them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, run_train, tb_scalars

VAL = "validation_metrics/loss"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--val-freq", type=int, default=25)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--ngpu", type=int, default=2)
    ap.add_argument("--png", default=str(REPO / "benchmarks" / "muon_vs_adamw.png"))
    ap.add_argument("--ns", action="store_true", help="time batched Newton-Schulz only")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--shape", default="96x64", help="one expert matrix, ROWSxCOLS")
    ap.add_argument("overrides", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    args.overrides = [a for a in args.overrides if a != "--"]
    return args


def curve(args, optimizer: str, lr: str) -> tuple[dict[int, float], float]:
    """{tokens: validation loss} of one run, and its wall time."""
    with tempfile.TemporaryDirectory(prefix="bench_muon_") as dump:
        t0 = time.perf_counter()
        run_train(
            dump,
            [
                "--training.steps",
                str(args.steps),
                "--optimizer.name",
                optimizer,
                "--optimizer.lr",
                lr,
                "--validation.enable",
                "true",
                "--validation.freq",
                str(args.val_freq),
                "--validation.steps",
                "8",
                "--checkpoint.enable",
                "false",
                "--metrics.log_freq",
                str(args.val_freq),
                "--lr_scheduler.warmup_steps",
                str(max(1, args.steps // 10)),
                *args.overrides,
            ],
            ngpu=args.ngpu,
            config=str(REPO / "configs" / "debug_model.toml"),
        )
        wall = time.perf_counter() - t0
        tokens = tb_scalars(dump, "n_tokens_seen")
        return {int(tokens[s]): v for s, v in sorted(tb_scalars(dump, VAL).items())}, wall


def tokens_to_reach(points: dict[int, float], target: float) -> float | None:
    """The first token count at which the curve reaches `target` (linear between points)."""
    prev = None
    for t, v in sorted(points.items()):
        if v <= target:
            if prev is None:
                return float(t)
            (t0, v0) = prev
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        prev = (t, v)
    return None


def plot(path: str, best: dict[str, tuple[str, dict[int, float]]]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 'plot: matplotlib is not installed (pip install -e ".[bench]"); not written'
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, (lr, points) in best.items():
        xs = sorted(points)
        ax.plot(
            [x / 1e6 for x in xs],
            [points[x] for x in xs],
            marker="o",
            ms=3,
            label=f"{name}, lr {lr}",
        )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss")
    ax.set_title("debug model on the stdlib corpus: AdamW vs Muon")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return f"plot: {path}"


def step_cost(ngpu: int) -> list[str]:
    """The optimizer step alone (one process, the debug model, fp32 weights), and Muon's
    bytes per step and rank at `ngpu` ranks (gather fp32 + all-gather bf16 results)."""
    import torch
    import torch.nn.functional as F

    from trainer.config.job import load_config
    from trainer.models.build import new_model
    from trainer.models.flavors import model_args
    from trainer.optim.muon import takes_muon
    from trainer.optim.optimizer import build_optimizer

    model = new_model(model_args("debugmodel", vocab_size=2048, max_seq_len=256))
    model.init_weights(seed=0)
    t = torch.randint(0, 2048, (2, 257))
    F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
    rows, times = [], {}
    for name in ("AdamW", "Muon"):
        opt = build_optimizer(model, load_config(["--optimizer.name", name]).optimizer)
        opt.step()
        samples = []
        for _ in range(10):
            t0 = time.perf_counter()
            opt.step()
            samples.append(time.perf_counter() - t0)
        times[name] = statistics.median(samples)
    n = sum(p.numel() for name, p in model.named_parameters() if takes_muon(name, p))
    share = (ngpu - 1) / ngpu / ngpu  # a rank's shard, less the part it owns itself
    rows.append(
        f"optimizer step alone (debug model, one process): AdamW {times['AdamW'] * 1e3:.1f}"
        f" ms, Muon {times['Muon'] * 1e3:.1f} ms ({times['Muon'] / times['AdamW']:.1f}x)"
    )
    rows.append(
        f"Muon's traffic per step and rank at {ngpu} ranks (two all-to-alls): {n:,} "
        f"matrix parameters x (4 B updates out + 2 B results in) x {share:.3f} = "
        f"{6 * n * share / 2**20:.1f} MiB"
    )
    return rows


def ns_batched_vs_loop(experts: int, rows: int, cols: int) -> list[str]:
    """Newton-Schulz (5 steps) of `experts` [rows, cols] matrices: batched vs per matrix."""
    import torch

    from trainer.optim.newton_schulz import orthogonalize

    g = torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(0))
    out = [
        f"Newton-Schulz of {experts} experts of [{rows}, {cols}], 5 steps, "
        f"{torch.get_num_threads()} threads (median of 10):"
    ]
    for dtype in (torch.float32, torch.bfloat16):

        def loop():
            return torch.stack([orthogonalize(m, 5, dtype) for m in g])

        def batch():
            return orthogonalize(g, 5, dtype)

        times = {}
        for name, fn in (("loop", loop), ("batched", batch)):
            fn()
            samples = []
            for _ in range(10):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            times[name] = statistics.median(samples)
        diff = (loop().float() - batch().float()).abs().max().item()
        out.append(
            f"  {str(dtype).removeprefix('torch.'):8}: per-matrix loop "
            f"{times['loop'] * 1e3:.2f} ms, batched {times['batched'] * 1e3:.2f} ms "
            f"({times['loop'] / times['batched']:.2f}x); max difference {diff:.1e}"
        )
    return out


def main(argv) -> int:
    args = parse_args(argv)
    if args.ns:
        rows, cols = (int(x) for x in args.shape.split("x"))
        print("\n".join(ns_batched_vs_loop(args.experts, rows, cols)))
        return 0
    runs = {}
    for name in ("AdamW", "Muon"):
        for lr in args.lrs.split(","):
            points, wall = curve(args, name, lr)
            runs[(name, lr)] = points
            print(
                f"{name:5} lr {lr:>6}: "
                + " ".join(f"{v:.3f}" for _, v in sorted(points.items()))
                + f"  (final {points[max(points)]:.4f}, {wall:.0f} s)",
                flush=True,
            )
    best = {}
    for name in ("AdamW", "Muon"):
        lr = min(
            (lr for n, lr in runs if n == name),
            key=lambda lr: runs[(name, lr)][max(runs[(name, lr)])],
        )
        best[name] = (lr, runs[(name, lr)])
    (a_lr, a), (m_lr, m) = best["AdamW"], best["Muon"]
    total = max(a)
    print(
        f"\nbest: AdamW lr {a_lr} final {a[total]:.4f}; Muon lr {m_lr} final {m[max(m)]:.4f} "
        f"({total:,} tokens each)"
    )
    print(f"{'tokens':>10} {'AdamW':>8} {'Muon':>8}")
    for t in sorted(a):
        print(f"{t:>10,} {a[t]:>8.4f} {m.get(t, float('nan')):>8.4f}")
    reach = tokens_to_reach(m, a[total])
    print(
        f"Muon reaches AdamW's final validation loss {a[total]:.4f} at "
        + (
            f"{reach:,.0f} tokens: {reach / total:.2f}x AdamW's tokens"
            if reach
            else "no point of the run: it ends above it"
        )
    )
    print(plot(args.png, best))
    for row in step_cost(args.ngpu):
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
