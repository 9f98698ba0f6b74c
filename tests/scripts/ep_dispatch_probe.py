"""Under torchrun on 4 gloo ranks as 2 "nodes" of 2 (two launchers, --nnodes 2: LOCAL_WORLD_SIZE
= 2): an MoE layer (8 experts in 2 groups, top 3 of 2 groups, one shared expert) at EP 4 with
the flat and the node-limited dispatch against the same layer on one rank; under activation
checkpointing (the trainer's own `_checkpoint_forward`) against no AC; the collectives each
phase issues; and the timeline of an overlapped dispatch with a large payload. Writes
rank<R>.json into the folder given."""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from trainer.models.args import MoEArgs
from trainer.models.common.moe import MoE
from trainer.parallel.expert_parallel import AllToAllDispatch, apply_ep
from trainer.parallel.parallelize import _checkpoint_forward

CALLS: list[dict] = []
PHASE = ["setup"]
LATE = [None]  # the rank that issues its asynchronous all-to-alls LATE_S late (the overlap tries)
LATE_S = 0.25  # the others check their transfer microseconds after issuing it


def record() -> None:
    original = dist.all_to_all_single

    def wrapped(out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        ranks = dist.get_process_group_ranks(group)
        sends = in_splits or [inp.shape[0] // len(ranks)] * len(ranks)
        CALLS.append(
            {
                "phase": PHASE[0],
                "dtype": str(inp.dtype),
                "to": [r for r, n in zip(ranks, sends, strict=True) if n and r != dist.get_rank()],
            }
        )
        if async_op and LATE[0] == dist.get_rank():
            time.sleep(LATE_S)
        return original(out, inp, out_splits, in_splits, group=group, async_op=async_op)

    dist.all_to_all_single = wrapped


class Block(nn.Module):
    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return x + self.moe(x)


def layer(args: MoEArgs, dim: int) -> MoE:
    torch.manual_seed(0)
    moe = MoE(dim, args)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.3)
    moe.router.expert_bias.normal_(std=0.1)
    return moe


def run(block: Block, x: torch.Tensor, probe: torch.Tensor):
    """(output, {parameter: gradient}) of sum(block(x) * probe)."""
    x = x.clone().requires_grad_(True)
    PHASE[0] = "forward"
    y = block(x)
    PHASE[0] = "backward"
    (y * probe).sum().backward()
    PHASE[0] = "setup"
    grads = {
        n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
        for n, p in block.named_parameters()
    }
    grads["input"] = x.grad.clone()
    block.zero_grad()
    return y.detach(), grads


def main(argv: list[str]) -> None:
    out_dir = argv[0]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record()
    dim, tokens = 16, 12
    args = MoEArgs(
        n_experts=8,
        top_k=3,
        hidden_dim=8,
        n_shared_experts=1,
        score_func="sigmoid",
        route_scale=2.5,
        n_group=2,
        topk_group=2,
    )
    torch.manual_seed(1)
    x_all = torch.randn(world, tokens, dim)
    probe_all = torch.randn(world, tokens, dim)
    x, probe = x_all[rank], probe_all[rank]

    ref = Block(layer(args, dim))  # one rank: every rank's tokens, every expert here
    want_y, want = run(ref, x_all.reshape(-1, dim), probe_all.reshape(-1, dim))
    want_y = want_y.view(world, tokens, dim)[rank]
    want["input"] = want["input"].view(world, tokens, dim)[rank]

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    block = Block(layer(args, dim))
    apply_ep(block, mesh)  # auto: node-limited (2 nodes, n_group 2)
    local = args.n_experts // world
    report = {"rank": rank, "auto": type(block.moe.dispatcher).__name__, "diffs": {}, "calls": {}}
    flat = AllToAllDispatch(mesh.get_group(), args.n_experts, True)
    node = block.moe.dispatcher
    for name, dispatcher in (("flat", flat), ("node", node)):
        block.moe.dispatcher = dispatcher
        CALLS.clear()
        y, grads = run(block, x, probe)
        report["calls"][name] = list(CALLS)
        diffs = {"output": (y - want_y).abs().max().item()}
        for key, g in grads.items():
            w = want[key]
            if key.startswith("moe.experts."):
                w = w[rank * local : (rank + 1) * local]
            elif key != "input":  # replicated parameters: every rank's share summed
                dist.all_reduce(g)
            diffs[key] = (g - w).abs().max().item()
        report["diffs"][name] = diffs
        # Under full AC (the trainer's checkpointed forward with its HostMemo): the same
        # output and gradients, and the collectives the recompute issues.
        ac = Block(block.moe)
        _checkpoint_forward(ac)
        CALLS.clear()
        y_ac, grads_ac = run(ac, x, probe)
        report["calls"][name + "_ac"] = list(CALLS)
        report["diffs"][name + "_ac_vs_no_ac"] = max(
            [(y_ac - y).abs().max().item()]
            + [(grads_ac[k] - g).abs().max().item() for k, g in run(block, x, probe)[1].items()]
        )
    # The overlap: a payload large enough that the dispatch is still on the wire while the
    # shared experts compute.
    big_dim, big_tokens = 512, 2048
    big = MoE(
        big_dim,
        MoEArgs(n_experts=8, top_k=3, hidden_dim=64, n_shared_experts=1, n_group=2, topk_group=2),
    )
    apply_ep(nn.ModuleDict({"m": big}), mesh)
    timelines = {}
    for name, dispatcher in (
        ("flat", AllToAllDispatch(mesh.get_group(), 8, True)),
        ("node", big.dispatcher),
    ):
        big.dispatcher = dispatcher
        timelines[name] = []
        # One try per rank, each with another rank late to issue the dispatch: the others'
        # transfers cannot complete before their shared experts start (a rank descheduled for
        # LATE_S under load could still see one finish; the late rank itself may).
        for late in range(dist.get_world_size()):
            LATE[0] = late
            dispatcher.timeline = []
            with torch.no_grad():
                big(torch.randn(big_tokens, big_dim))
            t0 = dispatcher.timeline[0][1]
            timelines[name].append(
                [(e, round(t - t0, 6), busy) for e, t, busy in dispatcher.timeline]
            )
        LATE[0] = None
    report["timeline"] = timelines
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    import os

    os._exit(0)
