"""Expert parallelism: each MoE layer's E experts split over the `ep` ranks (E / ep each), the
routed tokens sent to their experts' ranks and the outputs brought back by all-to-all.

The ep group borrows its ranks from `dp_shard` (trainer/parallel/dims.py splits it into
`(efsdp, ep)`): every rank still reads its own samples and runs attention, the router and the
dense layers on them, and FSDP still shards those over the whole `dp_shard`. The experts'
stacked weights become DTensors `Shard(0)` over `ep`, which FSDP shards further over `efsdp`
(trainer/parallel/fsdp.py), so a checkpoint holds each as one full `[E, ...]` tensor and moves
between ep degrees, dp sizes and layouts like a dense parameter.

One MoE layer's forward on an ep rank (`AllToAllDispatch`, the flat dispatch; the node-limited
one is trainer/parallel/ep_dispatch.py's `NodeDispatch`, chosen by `moe.dispatch`):
1. its (token, expert) pairs sorted by expert (so by destination rank: rank j holds experts
   j E/ep .. (j + 1) E/ep - 1), and the per-expert counts;
2. the counts are exchanged (an all-to-all of E integers, and one host sync: the split sizes
   must be known on the host), then the rows, each with its weight as one more column (an
   all-to-all issued asynchronously: the shared experts run meanwhile; its backward sends the
   gradients back the same way). Under activation checkpointing the recompute replays the
   counts and split sizes, and (`moe.save_dispatch`) the received rows (trainer/parallel/
   recompute.py): no second exchange, host sync or dispatch;
3. the received rows, grouped by source rank, are re-sorted by local expert for the grouped
   GEMM, weighted, unsorted and returned by the reverse all-to-all, then summed per token.

Expert gradients are the sum over every ep rank's tokens (the all-to-all's backward brings
them), so FSDP's reduction over `efsdp` (x replicas) must divide by the whole dp size, as it does
for the dense parameters: `gradient_divide_factor`. The balancing loads are counted before
dispatch (trainer/models/common/moe.py), so `balance_experts` is the same with and without ep.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.errors import ConfigError
from trainer.models.common.moe import MoE, capacity, expert_counts, moe_layers
from trainer.parallel.ep_dispatch import (
    Dispatcher,
    NodeDispatch,
    Route,
    exchange,
    node_fallback,
    node_layout,
    scatter_sum,
)


class AllToAllDispatch(Dispatcher):
    """An MoE layer's flat dispatcher over the ep process group (see the module docstring)."""

    def describe(self) -> str:
        return "flat: one all-to-all row per (token, expert)"

    @torch.compiler.disable
    def __call__(self, flat, weights, chosen, keep, experts, side=None):
        ep, local = self.ep, self.local
        t, k = chosen.shape
        n_experts = ep * local
        slots = chosen.reshape(-1)
        if keep is not None:  # capacity's dropped pairs sort last and are not sent
            slots = slots + keep.logical_not() * n_experts
        order = slots.argsort(stable=True)
        counts = expert_counts(slots, 2 * n_experts)[:n_experts].view(ep, local)
        # the kept pairs' static bound (what the traced dry run's perfect balance sends)
        bound = t * k if keep is None else min(t * k, n_experts * capacity(self.moe, t))
        received, (send, recv) = self.exchange_counts(counts, bound)
        pair = order[: sum(send)]
        token = pair.div(k, rounding_mode="floor")
        rows = torch.cat([flat[token], weights.reshape(-1)[pair, None].to(flat.dtype)], 1)
        route = Route(self.group, send, recv)
        mine, flight = exchange(rows, route, self.save)
        self._mark("dispatch issued", flight)
        shared = self.side(side, flat, flight)
        flight.wait()
        self._mark("dispatch received", flight)
        out = self.run_experts(mine, received, experts)
        back, flight = exchange(out, route.reverse())
        flight.wait()
        return scatter_sum(back, token, t), shared

    def sizes(self, counts: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """[2, ep]: rows sent to each ep rank, rows received from each."""
        return torch.stack([counts.sum(1), received.sum(1)])

    def balanced(self, rows: int) -> list[list[int]]:
        """Perfect balance (the traced dry run): an equal share of the rows to each rank."""
        share = [rows // self.ep + (1 if r < rows % self.ep else 0) for r in range(self.ep)]
        return [share, list(share)]


def choose_dispatcher(group, moe) -> Dispatcher:
    """`moe.dispatch` over the ep `group`: node-limited where asked (refused in one line when
    the layout cannot) or, under "auto", where the group spans several nodes and the expert
    groups match them; flat otherwise. The same decision on every rank."""
    nodes, why = node_layout(group, moe.n_experts, moe.n_group)
    if moe.dispatch == "node" and why:
        raise ConfigError(f"moe.dispatch = 'node': {why}")
    if moe.capacity_factor > 0 and moe.dispatch == "node":
        raise ConfigError(
            "moe.dispatch = 'node' is dropless: set moe.capacity_factor = 0 or "
            "moe.dispatch = 'flat'"
        )
    # Only the node-limited dispatch keeps its inter-node rows for the recompute (topk_group
    # rows per token); the flat dispatch's top_k rows per token would cost too much memory
    # (Kimi K2 on 512 H100s: +52 GiB per rank, DOES NOT FIT), so it sends them again.
    save = moe.save_dispatch and nodes > 1
    if moe.dispatch == "node" or (
        moe.dispatch == "auto" and nodes > 1 and not why and moe.capacity_factor == 0
    ):
        return NodeDispatch(group, moe.n_experts, nodes, moe.topk_group, moe.top_k, save)
    flat = AllToAllDispatch(group, moe.n_experts, False)
    flat.moe = moe  # the capacity's bound on the trace
    return flat


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Place each MoE layer's experts `Shard(0)` over `ep_mesh` (on the meta device: nothing is
    allocated) and install its dispatcher (one line says which)."""
    from trainer.distributed import log0

    group = ep_mesh.get_group()
    said = False
    for moe in moe_layers(model).values():
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(
                name,
                nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)),
            )
        moe.dispatcher = choose_dispatcher(group, moe.moe)
        if not said:  # the startup line (stderr in the plan: its stdout may be JSON)
            m = moe.moe
            nodes, why = node_layout(group, m.n_experts, m.n_group)
            line = (
                f"expert parallel {ep_mesh.size()}, dispatch {m.dispatch}: "
                f"{moe.dispatcher.describe()}{node_fallback(m.dispatch, nodes, why)}"
            )
            log0(line) if "RANK" in os.environ else print(line, file=sys.stderr)
            said = True


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts (GroupedExperts) of every MoE block of `model` that ep has placed."""
    return [
        m.experts
        for m in moe_layers(model).values()
        if isinstance(m, MoE) and m.dispatcher is not None
    ]
