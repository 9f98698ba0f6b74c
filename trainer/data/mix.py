"""`python -m trainer.data.mix`: what a blend will feed a run, before launching it.

    python -m trainer.data.mix --config configs/blend.toml --steps 20000 --world-size 64 \
        [--data.mix_weights web=0.6,code=0.4] [--section.key value ...]

For the config (with its CLI overrides, as run_train.sh takes them) and a number of steps from
the start of a stage, prints per source: its share, the size of its store, the samples and
tokens it contributes, how many epochs that is, and the steps at which it starts each new
epoch. The counts are the blend's own (trainer/data/blend.py), exact, not estimates. Stores
are checked by size only (the run checks checksums).
"""

from __future__ import annotations

import argparse
import sys

from trainer.errors import DataError, UserError

MAX_WRAPS_SHOWN = 4


def plan_rows(cfg, steps: int, world_size: int) -> tuple[list[dict], int]:
    """([{name, share, store_tokens, windows, samples, tokens, epochs, wraps}], global batch)."""
    from dataclasses import replace

    from trainer.config.job import accumulation_steps
    from trainer.data.blend import Blend
    from trainer.data.build import mix_sources, open_mix_stores
    from trainer.parallel.dims import ParallelDims

    if not cfg.data.mix:
        raise DataError("data.mix is empty: this command shows a blend ([[data.mix]] tables)")
    pd = ParallelDims.from_config(cfg.parallelism, world_size)
    gbs = cfg.training.local_batch_size * pd.dp_size * accumulation_steps(cfg.training, pd.dp_size)
    stores, _ = open_mix_stores(replace(cfg.data, verify_store="sizes"))
    sources = mix_sources(
        cfg.data,
        stores,
        split="train",
        seq_len=cfg.training.seq_len,
        local_batch_size=1,
        global_batch_size=1,
        dp_rank=0,
        dp_size=1,
        seed=cfg.job.seed,
    )
    weights = cfg.data.mix_weights_by_name()
    blend = Blend({n: w for n, w in weights.items() if w > 0}, cfg.job.seed)
    total = steps * gbs
    rows = []
    for name, src in sources.items():
        k, n = blend.count(name, total), src.n_windows
        wraps = []
        for epoch in range(1, k // n + 1):
            if len(wraps) == MAX_WRAPS_SHOWN:
                wraps.append("...")
                break
            wraps.append(str(blend.first_sample_reaching(name, epoch * n + 1, 0, 0) // gbs + 1))
        rows.append(
            {
                "name": name,
                "share": blend.fractions.get(name, 0.0),
                "store_tokens": src.store.total_tokens,
                "windows": n,
                "samples": k,
                "tokens": k * cfg.training.seq_len,
                "epochs": k / n,
                "wraps": wraps,
            }
        )
    return rows, gbs


def format_plan(rows: list[dict], steps: int, gbs: int, seq_len: int) -> str:
    lines = [
        f"{steps:,} steps x {gbs:,} samples of {seq_len} tokens = {steps * gbs:,} samples, "
        f"{steps * gbs * seq_len:,} training tokens",
        f"{'source':<12}{'weight':>8}{'store tokens':>15}{'windows':>10}{'samples':>12}"
        f"{'tokens':>15}{'realised':>10}{'epochs':>8}  new epoch at step",
    ]
    for r in rows:
        realised = r["samples"] / max(1, steps * gbs)
        lines.append(
            f"{r['name']:<12}{r['share']:>8.1%}{r['store_tokens']:>15,}"
            f"{r['windows']:>10,}{r['samples']:>12,}{r['tokens']:>15,}"
            f"{realised:>10.2%}{r['epochs']:>8.2f}  {', '.join(r['wraps']) or '-'}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.data.mix", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", required=True, help="the run's TOML file")
    parser.add_argument("--steps", type=int, help="steps to plan (default: training.steps)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="ranks of the run (the global batch may depend on it; default 1)",
    )
    args, overrides = parser.parse_known_args(argv)
    try:
        from trainer.config.job import load_config

        cfg = load_config(["--job.config_file", args.config, *overrides])
        steps = args.steps or cfg.training.steps
        if steps < 1 or args.world_size < 1:
            raise DataError("--steps and --world-size must be >= 1")
        rows, gbs = plan_rows(cfg, steps, args.world_size)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return e.exit_code
    print(format_plan(rows, steps, gbs, cfg.training.seq_len))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
