"""The optimizer step on DTensors: torch.optim.AdamW through DTensor's dispatch against the
trainer's AdamW, which steps each DTensor's local shard (trainer/optim/optimizer.py).

    torchrun --nproc_per_node 2 benchmarks/optim/bench_adam_local.py [--params 40 160 640]
        [--steps 6]

One launch, both optimizers side by side on the same FSDP-sharded stack of 64x64 Linears
(weights and biases: --params tensors), fused and foreach: the first step (DTensor propagates
the shardings of the whole tensor list; its cache is cold) and the median of the later steps,
in milliseconds on rank 0. The update is the same to the bit (tests/test_adam_shards.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from trainer.optim.optimizer import AdamW


def model(n_params: int, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(n_params // 2)])
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    net(torch.randn(8, 64)).sum().backward()
    return net


def timed(cls, n_params: int, impl: str, steps: int, mesh) -> tuple[float, float]:
    net = model(n_params, mesh)
    opt = cls(
        net.parameters(),
        lr=1e-3,
        weight_decay=0.1,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
    return times[0], statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, nargs="+", default=[40, 160, 640])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = []
    for n in args.params:
        for impl in ("fused", "foreach"):
            torch_first, torch_later = timed(torch.optim.AdamW, n, impl, args.steps, mesh)
            ours_first, ours_later = timed(AdamW, n, impl, args.steps, mesh)
            rows.append((n, impl, torch_first, ours_first, torch_later, ours_later))
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}, torch {torch.__version__}; ms on rank 0")
        print("| tensors | kernel | first step: torch / local | later steps: torch / local |")
        print("|---|---|---|---|")
        for n, impl, tf, of, tl, ol in rows:
            print(
                f"| {n} | {impl} | {tf:.1f} / {of:.1f} ({tf / of:.0f}x) | "
                f"{tl:.2f} / {ol:.2f} ({tl / ol:.1f}x) |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
