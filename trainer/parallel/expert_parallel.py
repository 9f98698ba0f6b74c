"""Expert parallelism: each MoE layer's E experts split over the `ep` ranks (E / ep each), the
routed tokens sent to their experts' ranks and the outputs brought back by all-to-all.

The ep group borrows its ranks from `dp_shard` (trainer/parallel/dims.py splits it into
`(efsdp, ep)`): every rank still reads its own samples and runs attention, the router and the
dense layers on them, and FSDP still shards those over the whole `dp_shard`. The experts'
stacked weights become DTensors `Shard(0)` over `ep`, which FSDP shards further over `efsdp`
(trainer/parallel/fsdp.py), so a checkpoint holds each as one full `[E, ...]` tensor and moves
between ep degrees, dp sizes and layouts like a dense parameter.

One MoE layer's forward on an ep rank (`AllToAllDispatch`):
1. its routed rows, sorted by expert (so by destination rank: rank j holds experts
   j E/ep .. (j + 1) E/ep - 1), and the per-expert counts;
2. the counts are exchanged (an all-to-all of E integers, and one host sync: the split sizes
   must be known on the host), then the rows (an autograd-aware all-to-all with uneven splits;
   its backward sends the gradients back the same way). Under activation checkpointing the
   recompute replays the counts and split sizes its forward exchanged (trainer/parallel/
   recompute.py): no second exchange or host sync;
3. the received rows, grouped by source rank, are re-sorted by local expert for the grouped
   GEMM, and the outputs unsorted and returned by the reverse all-to-all.

Expert gradients are the sum over every ep rank's tokens (the all-to-all's backward brings
them), so FSDP's reduction over `efsdp` (x replicas) must divide by the whole dp size, as it does
for the dense parameters: `gradient_divide_factor`. The balancing loads are counted before
dispatch (trainer/models/moe.py), so `balance_experts` is the same with and without ep.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.models.moe import MoE, moe_layers
from trainer.parallel import recompute


class AllToAllDispatch:
    """An MoE layer's dispatcher over the ep process group (see the module docstring)."""

    def __init__(self, group, ep: int, n_experts: int):
        self.group, self.ep, self.local = group, ep, n_experts // ep

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module):
        import torch.distributed as dist

        ep, local = self.ep, self.local
        memo = recompute.current()  # under activation checkpointing: the forward's values
        known = memo.replay() if memo is not None else None
        if known is None:
            received = torch.empty_like(counts)  # [ep x local]: per source, per local expert
            dist.all_to_all_single(received, counts, group=self.group)
            received = received.view(ep, local)
            send, recv = self.split_sizes(rows, counts, received)
            if memo is not None:
                memo.record((received, send, recv))
        else:  # the recompute: no second exchange, no second host sync
            received, send, recv = known
        extra = rows.shape[0] - sum(send)  # rows past the counted ones (capacity's padding)
        if extra:
            rows = rows[:-extra]
        mine = all_to_all_single_autograd(rows, recv, send, self.group)
        # Rows arrive grouped by source rank, then by local expert: sort by local expert
        # (the output size is known from the splits: no second host sync).
        expert_of_row = torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(
            received.reshape(-1), output_size=mine.shape[0])
        order = expert_of_row.argsort(stable=True)
        out = experts(mine[order], received.sum(0))[order.argsort()]
        back = all_to_all_single_autograd(out, send, recv, self.group)
        return torch.nn.functional.pad(back, (0, 0, 0, extra)) if extra else back

    def split_sizes(self, rows: torch.Tensor, counts: torch.Tensor,
                    received: torch.Tensor) -> tuple[list[int], list[int]]:
        """(rows sent to each ep rank, rows received from each): the layer's one host sync,
        since the all-to-all's split sizes must be known on the host. The traced dry run
        (trainer/plan/trace.py) replaces it with perfect balance: fake tensors have no data."""
        splits = torch.stack([counts.view(self.ep, self.local).sum(1), received.sum(1)])
        send, recv = splits.tolist()
        return send, recv


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Place each MoE layer's experts `Shard(0)` over `ep_mesh` (on the meta device: nothing is
    allocated) and install its all-to-all dispatcher."""
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    for moe in moe_layers(model).values():
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(
                param, ep_mesh, [Shard(0)], src_data_rank=None)))
        moe.dispatcher = AllToAllDispatch(group, ep, moe.moe.n_experts)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts (GroupedExperts) of every MoE block of `model` that ep has placed."""
    return [m.experts for m in moe_layers(model).values()
            if isinstance(m, MoE) and m.dispatcher is not None]
