"""What QK-clip (`optimizer.muon_qk_clip`) costs: the attention's forward + backward with and
without the per-head maxima (trainer/models/common/logits.py), then a training step of the product
with and without the clip (run_train.sh, Muon, the same run otherwise), in one run.

    python benchmarks/optim/bench_qk_clip.py [--seq 256,1024] [--steps 30] [--ngpu 1] \
        [--flavor debugmodel-dsv3] [--repeat 20]

On a CPU the maxima are the chunked reduction (one more q.k^T per layer in the forward); on
CUDA FlexAttention returns them from its kernel (block_causal), and the SDPA paths take the
reduction too. Prints a table: ms per attention call without / with, and the ratio; then the
median step time of the two runs and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import run_train, tb_scalars


def time_attention(
    seq: int, heads: int, head_dim: int, batch: int, repeat: int, record: bool
) -> float:
    from trainer.models.common.attention import attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, seq, heads, head_dim, generator=gen, requires_grad=True)
        for _ in range(3)
    )
    buf = torch.full((heads,), float("-inf")) if record else None
    times = []
    for _ in range(repeat + 2):
        t0 = time.perf_counter()
        attend(q, k, v, None, logit_max=buf).sum().backward()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def step_time(overrides: list[str], ngpu: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as dump:
        run_train(
            dump,
            [
                "--training.steps",
                str(steps),
                "--metrics.log_freq",
                "1",
                "--checkpoint.enable",
                "false",
                *overrides,
            ],
            ngpu=ngpu,
            config="configs/debug_dsv3.toml",
        )
        secs = tb_scalars(dump, "time_metrics/end_to_end(s)")
        return statistics.median(list(secs.values())[5:]) if secs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", default="256,1024")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ngpu", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"attention fwd+bwd, {a.heads} heads x {a.head_dim}, batch {a.batch}, causal, 1 thread")
    print("| seq | ms without | ms with maxima | ratio |\n|---|---|---|---|")
    for seq in map(int, a.seq.split(",")):
        base = time_attention(seq, a.heads, a.head_dim, a.batch, a.repeat, False)
        with_max = time_attention(seq, a.heads, a.head_dim, a.batch, a.repeat, True)
        print(f"| {seq} | {base:.2f} | {with_max:.2f} | {with_max / base:.2f}x |")
    common = [
        "--optimizer.name",
        "Muon",
        "--training.device",
        "cpu",
        "--parallelism.expert_parallel_degree",
        str(a.ngpu),
        "--training.mixed_precision_param",
        "float32",
    ]
    plain = step_time(common, a.ngpu, a.steps)
    clipped = step_time([*common, "--optimizer.muon_qk_clip", "100"], a.ngpu, a.steps)
    print(
        f"\nstep (configs/debug_dsv3.toml, Muon, {a.ngpu} rank(s), median of steps 6-"
        f"{a.steps}): {plain * 1e3:.0f} ms without QK-clip, {clipped * 1e3:.0f} ms with "
        f"({clipped / plain:.3f}x)"
    )


if __name__ == "__main__":
    main()
