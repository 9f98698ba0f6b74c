"""Training stall per checkpoint save, synchronous against asynchronous, side by side.

    python benchmarks/checkpoint/bench_checkpoint.py [--repeats 3] [--steps 12] [--interval 3] \
        [-- overrides ...]

Runs the debug model on 2 ranks through run_train.sh three ways, interleaved run by run so a
shared machine's drift hits all alike: no checkpointing, `async_mode = disabled` (sync) and
`async_mode = async`, saving every `interval` steps. Per-step times are the trainer's own
(`time_metrics/end_to_end(s)`, logged every step). A save at step N runs after step N's log,
so its cost lands in step N+1's time. Two figures per mode:
- direct stall: step N+1's time minus the median time of the steps no save touched, averaged
  over the saves (sync: the whole write; async: staging to CPU memory plus waiting for the
  previous save to finish);
- total stall: (sum of the step times - the same number of no-checkpoint median steps) / saves;
  it also counts the background write slowing the steps it overlaps (2 cores are shared by
  the training ranks and the writer threads here).
The last step's save (always made) and the end-of-run wait fall outside every step's time and
are not counted. The rank-0 console lines `saved checkpoint ... in X s` / `staged in X s` are
reported as well.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, run_train, tb_scalars

MODES = {
    "none": ["--checkpoint.enable", "false"],
    "sync": ["--checkpoint.enable", "true", "--checkpoint.async_mode", "disabled"],
    "async": ["--checkpoint.enable", "true", "--checkpoint.async_mode", "async"],
}


def one_run(mode: str, a, overrides: list[str]) -> dict:
    """Step times {step: s} and the console's save timings for one run of one mode."""
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as dump:
        args = [
            "--training.steps",
            str(a.steps),
            "--metrics.log_freq",
            "1",
            "--checkpoint.interval",
            str(a.interval),
            "--checkpoint.keep_latest_k",
            "2",
            *MODES[mode],
            *overrides,
        ]
        proc, _ = run_train(dump, args, ngpu=2, config=str(REPO / "configs" / "debug_model.toml"))
        steps = tb_scalars(dump, "time_metrics/end_to_end(s)")
    out = proc.stdout + proc.stderr
    return {
        "steps": steps,
        "saved_s": [float(x) for x in re.findall(r"saved checkpoint \S+ in ([\d.]+)s", out)],
        "staged_s": [float(x) for x in re.findall(r"staged in ([\d.]+)s", out)],
    }


def stalls(run: dict, a, none_median: float) -> dict:
    """Direct and total stall per save (see the module docstring) for one run."""
    steps = run["steps"]
    hit = [n + 1 for n in range(a.interval, a.steps, a.interval) if n + 1 in steps]
    clean = [t for s, t in steps.items() if s > 1 and s not in hit]
    base = statistics.median(clean)
    timed = [t for s, t in steps.items() if s > 1]  # step 1 carries start-up costs
    return {
        "direct": statistics.mean(steps[s] - base for s in hit) if hit else 0.0,
        "total": (sum(timed) - len(timed) * none_median) / max(len(hit), 1),
        "median_step": base,
        "saves_counted": len(hit),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("overrides", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    overrides = [x for x in a.overrides if x != "--"]
    runs = {m: [] for m in MODES}
    for i in range(a.repeats):
        for mode in MODES:
            runs[mode].append(one_run(mode, a, overrides))
            print(f"repeat {i + 1}/{a.repeats} {mode}: done", flush=True)
    none_medians = [
        statistics.median(t for s, t in r["steps"].items() if s > 1) for r in runs["none"]
    ]
    result = {"no_checkpoint_median_step_s": statistics.median(none_medians)}
    print(
        f"debug model, 2 ranks, {a.steps} steps, save every {a.interval} "
        f"({len(range(a.interval, a.steps, a.interval))} saves timed per run), "
        f"{a.repeats} runs per mode, medians over runs"
    )
    print(f"  no checkpointing: median step {result['no_checkpoint_median_step_s']:.3f} s")
    for mode in ("sync", "async"):
        per_run = [stalls(r, a, nm) for r, nm in zip(runs[mode], none_medians, strict=True)]
        med = {
            k: statistics.median(p[k] for p in per_run) for k in ("direct", "total", "median_step")
        }
        console = {
            k: statistics.median(v for r in runs[mode] for v in r[k])
            if any(r[k] for r in runs[mode])
            else None
            for k in ("saved_s", "staged_s")
        }
        result[mode] = {**med, "console": console, "direct_runs": [p["direct"] for p in per_run]}
        extra = f", staged in {console['staged_s']:.3f} s" if console["staged_s"] else ""
        print(
            f"  {mode:>5}: stall per save direct {med['direct']:.3f} s, total "
            f"{med['total']:.3f} s (median step {med['median_step']:.3f} s; console: saved in "
            f"{console['saved_s']:.3f} s{extra}); direct per run: "
            + ", ".join(f"{p['direct']:.3f}" for p in per_run)
        )
    if not a.no_record:
        append_result(
            {
                "bench": "checkpoint",
                "steps": a.steps,
                "interval": a.interval,
                "repeats": a.repeats,
                "overrides": overrides,
                **result,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
