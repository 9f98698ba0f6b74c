"""DualPipeV with and without its overlap on 4 CPU ranks (PP 2 x EP 2): step time.

    python benchmarks/parallel/bench_dualpipe.py [--steps 8] [--warmup 3] [--repeats 2] [--batch 8]

run_train.sh with debugmodel-moe (4 layers, 8 experts, fp32, synthetic tokens, seq 128) on 4
ranks: pp 2 x ep 2 (ep borrowed from dp_shard 2), DualPipeV over the stages [embedding,
layer 0] [1] [2] [3, head] (MoE layers on both pp ranks), `--batch` pipeline microbatches of
one sample per schedule step. The same run with `parallelism.pipeline_parallel_overlap` false
(each OVERLAP_F_B action's forward, then its backward) and true (the backward on a second
thread, its ep all-to-alls on twin groups: trainer/parallel/dualpipe.py), alternated
`--repeats` times so that a noisy neighbour hits both. The trainer's own per-step times
(TensorBoard) after the warm-up. On 2 shared cores the four ranks' compute already fills the
machine: the overlap can only hide the time a thread waits for its peers, so expect little
here; on GPUs the host-side waits it hides are the split sizes' sync and gloo/NCCL waits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, run_train, spread, tb_scalars


def overrides(batch: int, steps: int, overlap: bool) -> list[str]:
    return [
        "--training.device",
        "cpu",
        "--model.flavor",
        "debugmodel-moe",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        str(batch),
        "--training.global_batch_size",
        str(2 * batch),
        "--training.mixed_precision_param",
        "float32",
        "--data.dataset",
        "synthetic",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "true",
        "--checkpoint.enable",
        "false",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "DualPipeV",
        "--parallelism.pipeline_parallel_split_points",
        "layers.1,layers.2,layers.3",
        "--parallelism.pipeline_parallel_overlap",
        str(overlap).lower(),
    ]


def step_times(args: list[str], warmup: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="bench_dualpipe_") as dump:
        proc, _ = run_train(dump, args, ngpu=4, config=str(REPO / "configs" / "debug_model.toml"))
        said = "DualPipeV overlaps" in proc.stdout + proc.stderr
        if said != (args[-1] == "true"):
            raise SystemExit(f"the run with overlap {args[-1]} says otherwise on its startup line")
        times = tb_scalars(dump, "time_metrics/end_to_end(s)")
    return [v for s, v in sorted(times.items()) if s > warmup]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="microbatches per schedule step")
    args = ap.parse_args(argv)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for overlap in (False, True):
            times[overlap] += step_times(overrides(args.batch, args.steps, overlap), args.warmup)
    print(
        f"debugmodel-moe fp32, seq 128, PP 2 x EP 2 on 4 CPU ranks, DualPipeV, {args.batch} "
        f"microbatches per step; median step time after {args.warmup} warm-up steps, "
        f"{args.repeats} alternated runs each (p10-p90)"
    )
    rows = []
    for overlap in (False, True):
        t, s = statistics.median(times[overlap]), spread(times[overlap])
        name = "overlapped (2 threads)" if overlap else "forward then backward"
        print(f"  {name:<24} {t:>7.3f} s  {s['p10']:.3f}-{s['p90']:.3f}")
        rows.append({"overlap": overlap, "step_s": t, "p10": s["p10"], "p90": s["p90"]})
    speedup = rows[0]["step_s"] / rows[1]["step_s"]
    print(f"  speed-up of the overlap: {speedup:.3f}x")
    append_result({"bench": "dualpipe", "batch": args.batch, "rows": rows, "speedup": speedup})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
