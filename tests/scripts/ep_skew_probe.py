"""Expert parallelism under a skewed router, on 2 ranks (tests/test_moe.py).

Every rank builds the same MoE layer (debugmodel-moe's shape, seeded) and a reference copy.
The routing bias sends every token to experts 0 and 1, both held by ep rank 0, so rank 1's
experts get nothing and rank 0 computes every token of both ranks. The layer under ep
(trainer/parallel/expert_parallel.py) must give each rank's tokens the outputs, input gradients
and (summed over the ranks) expert gradients of the reference computed locally with all
experts. Then the same under a capacity factor (1.0: each expert keeps its first 12 pairs,
the rows past them padding that the dispatcher must not send). Prints one `result {json}`
line per rank.
"""

import copy
import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from trainer.models.common.moe import MoE
from trainer.models.flavors import FLAVORS
from trainer.parallel.expert_parallel import apply_ep


def holder(moe: MoE) -> nn.Module:
    """A model-shaped container (`layers.<i>.feed_forward`), as apply_ep expects."""
    root, block = nn.Module(), nn.Module()
    block.feed_forward = moe
    root.layers = nn.ModuleDict({"1": block})
    return root


def layers(moe_args, mesh) -> tuple[MoE, MoE]:
    """(the reference layer, its copy under ep), the same seeded weights on every rank."""
    torch.manual_seed(0)
    ref = MoE(FLAVORS["debugmodel-moe"].dim, moe_args)
    for p in ref.parameters():
        nn.init.normal_(p, std=0.05)
    ref.router.expert_bias.copy_(torch.tensor([100.0, 100.0] + [0.0] * (moe_args.n_experts - 2)))
    ep_moe = copy.deepcopy(ref)
    apply_ep(holder(ep_moe), mesh)
    return ref, ep_moe


def main(argv=None) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args = FLAVORS["debugmodel-moe"]
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    gen = torch.Generator().manual_seed(100 + rank)  # each rank's own tokens
    x = torch.randn(3, 16, args.dim, generator=gen)
    probe = torch.randn(3, 16, args.dim, generator=gen)
    result = compare(*layers(args.moe, mesh), x, probe, rank)
    capped = compare(
        *layers(dataclasses.replace(args.moe, capacity_factor=1.0), mesh), x, probe, rank
    )
    result.update({f"capacity_{k}": v for k, v in capped.items()})
    print("result " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def compare(ref: MoE, ep_moe: MoE, x, probe, rank: int) -> dict:
    outs, grads = [], []
    for layer in (ref, ep_moe):
        layer.train()
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        (y * probe).sum().backward()
        outs.append(y.detach())
        grads.append(xi.grad)
    # Expert gradients: the reference's summed over ranks, against this rank's ep shard.
    w1_ref = ref.experts.w1.grad.clone()
    dist.all_reduce(w1_ref)
    local = ep_moe.experts.w1.grad.to_local()
    lo = rank * local.shape[0]
    stats = ep_moe.take_stats()
    return {
        "rank": rank,
        "out_diff": (outs[0] - outs[1]).abs().max().item(),
        "grad_diff": (grads[0] - grads[1]).abs().max().item(),
        "tokens_without_grad": int((grads[1].flatten(0, 1).abs().sum(-1) == 0).sum()),
        "tokens": x.shape[0] * x.shape[1],
        "expert_grad_diff": (w1_ref[lo : lo + local.shape[0]] - local).abs().max().item(),
        "expert_grad_norm": local.norm().item(),
        "loads": stats["tokens_per_expert"].tolist(),
        "dropped": stats["dropped"].item(),
    }


if __name__ == "__main__":
    main(sys.argv[1:])
