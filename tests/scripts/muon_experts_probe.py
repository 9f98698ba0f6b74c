"""Under torchrun (4 ranks, a (2, 2) mesh named like expert parallelism's (efsdp, ep)): the
trainer's Muon on stacked expert tensors laid out as EP/FSDP lays them out, against
torch.optim.Muon on each expert slice alone (its own 2-D parameter, whole, on every rank), 3
steps, Newton-Schulz in bf16 (torch's): the weights must be bitwise equal. The layouts:

- w1 [8, 24, 16] (Shard(1), Shard(0)): experts split over ep, rows over efsdp (FSDP's
  `Shard(1)` when the local experts do not divide efsdp): each expert gathered over efsdp;
- w2 [8, 16, 24] (Shard(0), Shard(0)): experts split over ep and efsdp: whole where they live;
- w3 [4, 16, 24] (Replicate(), Shard(2)): replicas over efsdp, columns over ep;
- wq [32, 16] (Shard(0), Shard(1)): a dense matrix cut over both dims.

A stacked tensor orthogonalized as one [E x out, in] matrix is far from the per-slice result
(the check can fail). Then a layout whose local shard on rank 3 is not the block its
placements imply: every rank raises the same ConfigError while the optimizer is built.
Prints "muon experts probe ok ..." when it passes."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from trainer.errors import ConfigError
from trainer.optim.muon import Muon
from trainer.optim.newton_schulz import orthogonalize

LAYOUTS = {
    "layers.1.feed_forward.experts.w1": ((8, 24, 16), (Shard(1), Shard(0))),
    "layers.1.feed_forward.experts.w2": ((8, 16, 24), (Shard(0), Shard(0))),
    "layers.1.feed_forward.experts.w3": ((4, 16, 24), (Replicate(), Shard(2))),
    "layers.0.attention.wq.weight": ((32, 16), (Shard(0), Shard(1))),
}
HP = dict(lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True)


def muon(params, names) -> Muon:
    return Muon(
        params,
        None,
        ns_steps=5,
        lr_adjust="match_rms_adamw",
        ns_dtype="bfloat16",
        names=names,
        **HP,
    )


def check_slices(mesh) -> float:
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(shape, generator=gen) for n, (shape, _) in LAYOUTS.items()}
    params = {
        n: torch.nn.Parameter(distribute_tensor(full[n], mesh, list(pl)))
        for n, (_, pl) in LAYOUTS.items()
    }
    opt = muon(list(params.values()), list(params))
    slices = {
        n: [torch.nn.Parameter(m.clone()) for m in (t if t.ndim == 3 else [t])]
        for n, t in full.items()
    }
    ref = torch.optim.Muon(
        [p for s in slices.values() for p in s], adjust_lr_fn="match_rms_adamw", **HP
    )
    for _ in range(3):
        grads = {n: torch.randn(t.shape, generator=gen) for n, t in full.items()}
        for n, p in params.items():
            p.grad = distribute_tensor(grads[n], mesh, list(LAYOUTS[n][1]))
            for k, q in enumerate(slices[n]):
                q.grad = grads[n][k] if grads[n].ndim == 3 else grads[n]
        opt.step()
        ref.step()
    for n, p in params.items():
        want = torch.stack([q.detach() for q in slices[n]]).view(full[n].shape)
        assert torch.equal(p.full_tensor(), want), (n, (p.full_tensor() - want).abs().max())
    # the planted bug's size: one stack orthogonalized as a single [E x out, in] matrix
    g = torch.randn(8, 24, 16, generator=gen)
    per = orthogonalize(g, 5, torch.float32)
    whole = orthogonalize(g.reshape(-1, 16), 5, torch.float32).view(g.shape)
    return ((per - whole).abs().max() / per.abs().max()).item()


def check_refusal(mesh) -> str:
    shape, placements = (8, 16, 24), (Shard(0), Shard(0))
    local = torch.zeros(2, 16, 23 if dist.get_rank() == 3 else 24)
    bad = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=(16 * 24, 24, 1)
    )
    try:
        muon([torch.nn.Parameter(bad)], ["layers.1.feed_forward.experts.w2"])
    except ConfigError as e:
        return e.one_line()
    raise AssertionError("a wrong local shard was not refused")


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    gap = check_slices(mesh)
    assert gap > 1e-2, gap
    line = check_refusal(mesh)
    lines: list = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    assert len(set(lines)) == 1 and "rank 3" in line and "(2, 16, 23)" in line, lines
    if dist.get_rank() == 0:
        print(
            f"muon experts probe ok: bitwise torch.optim.Muon per expert slice; stacked as "
            f"one matrix {gap:.1e} away; refused on every rank: {line}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
