"""The all-to-all legs of an MoE layer's dispatch and combine, and the node-limited dispatch.

Both dispatchers (the flat one, `AllToAllDispatch` in trainer/parallel/expert_parallel.py, and
`NodeDispatch` here) take a layer's tokens, their chosen experts and weights, and return the
routed experts' weighted sum per token, built from the same pieces:

- **One count exchange and one host sync** per layer per microbatch (`Dispatcher.exchange_counts`):
  an all-to-all of a small integer table, then every split size read in one `tolist`. Under
  activation checkpointing the recompute replays the table and the sizes (trainer/parallel/
  recompute.py): no second exchange, no second sync.
- **Legs** (`exchange`): an all-to-all of rows, issued asynchronously (`Flight.wait()` before its
  output is read: the shared experts run while the dispatch is in flight). Its backward sends
  the gradients back the reverse way. `save=True` (the dispatch's legs under
  `moe.save_dispatch`): the recompute reuses the forward's received rows instead of sending
  again, as context parallelism's gathered K/V are saved; the memory is the received rows of
  every checkpointed MoE layer, from its forward to its backward.
- **The weights travel with the rows** (one column in the rows' dtype per weight, the value
  `weights.to(dtype)` the local path multiplies by) and are applied where the experts live;
  their gradients come back through the legs' backward. The combine's legs and the final sums
  (`_ScatterSum`) save nothing for backward, so a checkpointed block's recompute, which stops at
  its last saved tensor (torch's early stop), never reaches the combine.
- **Lanes**: every collective, forward and backward, goes out on `lane_group(group)` evaluated
  when it is issued (trainer/parallel/lanes.py: an overlapped pipeline's backward lane swaps in
  a twin group). Every leg is an all-to-all over the ep group itself: a stage that talks to
  some ranks only sends them rows and the others zero (NCCL and gloo skip empty peers), so no
  sub-group is created and the lanes' twin of the ep group serves every leg.

`NodeDispatch` (DeepEP / HybridEP style): the ep group spans N nodes of L ranks, and group g of
DeepSeek's group-limited routing (`moe.n_group` = N) is the experts of node g. A token crosses
to each of its chosen nodes once, to the rank with its own local index there, carrying its
chosen experts on that node and their weights; that rank fans it out to the experts' owners on
its node; the owners weight their outputs, the node sums a token's outputs and sends one row
back per (token, node). Inter-node bytes per token: topk_group rows instead of top_k.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from trainer.models.common.moe import expert_counts
from trainer.parallel import recompute
from trainer.parallel.lanes import lane_group


class Route:
    """One leg's split sizes over `group`: rows sent to and received from each rank."""

    def __init__(self, group, send: list[int], recv: list[int]):
        self.group, self.send, self.recv = group, send, recv

    def reverse(self) -> "Route":
        return Route(self.group, self.recv, self.send)


class Flight:
    """An issued all-to-all: `wait()` before its output is read."""

    def __init__(self):
        self.work = self.inputs = None

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work = self.inputs = None


def _all_to_all(out, inp, route: Route, async_op: bool = False):
    return dist.all_to_all_single(
        out, inp, route.recv, route.send, group=lane_group(route.group), async_op=async_op
    )


class _Exchange(torch.autograd.Function):
    """rows [sum(send), ...] -> the rows the other ranks sent [sum(recv), ...], asynchronously
    (`flight`); `saved`: the forward's output, returned without communicating (a replay)."""

    @staticmethod
    def forward(ctx, rows, route, flight, saved):
        ctx.route = route
        if saved is not None:
            return saved.detach()
        out = rows.new_empty((sum(route.recv), *rows.shape[1:]))
        flight.inputs = rows.contiguous()
        flight.work = _all_to_all(out, flight.inputs, route, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        route = ctx.route.reverse()
        out = grad.new_empty((sum(route.recv), *grad.shape[1:]))
        _all_to_all(out, grad.contiguous(), route)
        return out, None, None, None


class _ScatterSum(torch.autograd.Function):
    """rows summed into `n` rows by `index` (index_add), saving nothing for backward (the index
    is held by the graph itself): see the module docstring."""

    @staticmethod
    def forward(ctx, rows, index, n):
        ctx.index = index
        return rows.new_zeros((n, *rows.shape[1:])).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.index), None, None


def exchange(rows: torch.Tensor, route: Route, save: bool = False):
    """(output, its Flight): one all-to-all leg; with `save` under activation checkpointing
    the recompute gets the forward's output back (trainer/parallel/recompute.py)."""
    memo = recompute.current() if save else None
    held = memo.replay() if memo is not None else None
    flight = Flight()
    out = _Exchange.apply(rows, route, flight, held.pop() if held else None)
    if memo is not None and held is None:
        memo.record([out.detach()])  # popped by the replay: freed with the block's backward
    return out, flight


def scatter_sum(rows: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    return _ScatterSum.apply(rows, index, n)


class Dispatcher:
    """What both dispatchers share: the count exchange with its one host sync, the side work
    run while the dispatch is in flight, and a probe's timeline."""

    def __init__(self, group, n_experts: int, save: bool):
        self.group, self.ep, self.save = group, group.size(), save
        self.local = n_experts // self.ep
        self.timeline: list | None = None  # a probe's list: (event, time, in flight)

    def exchange_counts(self, table: torch.Tensor, tokens: int):
        """(the table [ep, c] each rank sent this one, the host split sizes): an all-to-all
        of `table` [ep, c] (row q: what this rank tells rank q), then `host_lists`."""
        memo = recompute.current()
        known = memo.replay() if memo is not None else None
        if known is not None:  # the recompute: no second exchange, no second host sync
            return known
        received = torch.empty_like(table)
        dist.all_to_all_single(received, table, group=lane_group(self.group))
        found = received, self.host_lists(self.sizes(table, received), tokens)
        if memo is not None:
            memo.record(found)
        return found

    def host_lists(self, sizes: torch.Tensor, tokens: int) -> list[list[int]]:
        """The layer's one host sync: the legs' split sizes must be known on the host. The
        traced dry run (trainer/plan/trace.py) replaces it with `balanced(tokens)`: fake
        tensors have no data."""
        return sizes.tolist()

    def run_experts(self, mine, per_source, experts):
        """The received rows [m, dim + 1] (grouped by source, then by local expert, as
        `per_source` [sources, local] counts them) -> their experts' weighted outputs in the
        same order."""
        local = self.local
        expert_of_row = (
            torch.arange(local, device=mine.device)
            .repeat(per_source.shape[0])
            .repeat_interleave(per_source.reshape(-1), output_size=mine.shape[0])
        )
        order = expert_of_row.argsort(stable=True)
        x = mine[order]
        rows = x[:, :-1]  # copied: the grouped GEMM wants 16-byte strides (an empty view not)
        rows = rows.contiguous() if rows.shape[0] else rows.new_zeros(rows.shape)
        # the weights copied out too: the product saves them for its backward, and a view
        # would keep the whole received [m, dim + 1] copy alive until then
        weights = x[:, -1:].clone()
        del x
        out = experts(rows, per_source.sum(0)) * weights
        return out[order.argsort()]

    def side(self, fn, x, flight: Flight):
        """`fn(x)` (the shared experts) while `flight` is in flight."""
        if fn is None:
            return None
        self._mark("side start", flight)
        out = fn(x)
        self._mark("side end", flight)
        return out

    def _mark(self, event: str, flight: Flight) -> None:
        if self.timeline is not None:
            self.timeline.append((event, time.perf_counter(), not flight.done()))


def ranks_per_node() -> int:
    """Ranks one machine runs: torchrun's LOCAL_WORLD_SIZE (the plan sets it from --ngpu)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size())


def node_layout(group, n_experts: int, n_group: int) -> tuple[int, str]:
    """`node_span` of the ep `group`'s global ranks: the same on every rank of the group."""
    return node_span(dist.get_process_group_ranks(group), ranks_per_node(), n_group)


def node_span(ranks: list[int], per: int, n_group: int) -> tuple[int, str]:
    """(the nodes an ep group of global `ranks` spans with `per` ranks a node, why
    node-limited dispatch cannot run there or ""): it needs moe.n_group = that node count and
    each group's experts (E / n_group, on ep / n_group consecutive ep ranks) on one node. The
    plan asks it of the layout's ranks (ParallelDims.ep_group_ranks), a run of its group's."""
    nodes = [r // per for r in ranks]
    n = len(set(nodes))
    if n_group != n:
        return n, (
            f"moe.n_group = {n_group}, but the ep group's {len(ranks)} ranks span {n} "
            f"node(s) of {per} rank(s): node-limited dispatch needs one expert group "
            "per node"
        )
    width = len(ranks) // n_group
    for g in range(n_group):
        if len(set(nodes[g * width : (g + 1) * width])) != 1:
            return n, (
                f"expert group {g} (ep ranks {g * width}..{(g + 1) * width - 1}, global "
                f"{ranks[g * width : (g + 1) * width]}) spans several nodes: the ep group's "
                "ranks are not node-major"
            )
    return n, ""


def node_fallback(dispatch: str, n_nodes: int, why: str) -> str:
    """What the startup line adds when `auto` runs the flat dispatch over several nodes: why
    node-limited dispatch does not run there (e.g. context parallelism strides the ep ranks
    over twice the nodes)."""
    if dispatch != "auto" or n_nodes <= 1 or not why:
        return ""
    return f"; node-limited dispatch not used: {why}"


class NodeDispatch(Dispatcher):
    """Node-limited two-stage dispatch and combine (see the module docstring)."""

    def __init__(
        self, group, n_experts: int, n_nodes: int, topk_group: int, top_k: int, save: bool
    ):
        super().__init__(group, n_experts, save)
        self.top_k = top_k
        self.n_nodes, self.per_node = n_nodes, self.ep // n_nodes
        self.group_size, self.topk_group = n_experts // n_nodes, topk_group
        me = dist.get_group_rank(group, dist.get_rank())
        self.node, self.lane = divmod(me, self.per_node)

    def describe(self) -> str:
        return (
            f"node-limited: {self.n_nodes} nodes x {self.per_node} ep ranks, expert group g "
            f"= node g's {self.group_size} experts; a token crosses to each chosen node once"
        )

    @torch.compiler.disable
    def __call__(self, flat, weights, chosen, keep, experts, side=None):
        n, per, g, local = self.n_nodes, self.per_node, self.group_size, self.local
        t, k = chosen.shape
        valid = torch.ones_like(chosen, dtype=torch.bool) if keep is None else keep.view(t, k)
        node = chosen // g
        present = (
            torch.zeros(t, n, dtype=torch.int64, device=flat.device).scatter_add_(
                1, node, valid.long()
            )
            > 0
        )  # [T, N]: the (token, node) pairs
        slot = torch.arange(n * t, device=flat.device)
        order = torch.where(present.t().reshape(-1), slot, n * t).argsort()  # by node, token
        loads = expert_counts(
            (chosen + valid.logical_not() * chosen.new_tensor(n * g)).reshape(-1), 2 * n * g
        )[: n * g]
        table = self.count_table(loads, present.sum(0))
        received, (send1, recv1, send2, recv2) = self.exchange_counts(table, t)
        pick = order[: sum(send1)]
        to, tok = pick.div(t, rounding_mode="floor"), pick % t
        mask = (node[tok] == to[:, None]) & valid[tok]  # [pairs, k]: choices on that node
        ids = torch.where(mask, chosen[tok] - to[:, None] * g, -1).to(torch.int32)
        rows = torch.cat([flat[tok], torch.where(mask, weights[tok], 0).to(flat.dtype)], 1)
        route1 = Route(self.group, send1, recv1)
        x1, flight = exchange(rows, route1, self.save)  # the inter-node stage
        ids1, id_flight = exchange(ids, route1, self.save)
        self._mark("dispatch issued", flight)
        shared = self.side(side, flat, flight)
        flight.wait()
        id_flight.wait()
        self._mark("dispatch received", flight)
        # This rank forwards its received pairs' choices to their owners on its node, sorted
        # by (owner, expert): the owner's rows come grouped by expert from each forwarder.
        ids_flat = ids1.reshape(-1).long()
        order2 = torch.where(ids_flat >= 0, ids_flat, g).argsort(stable=True)[: sum(send2)]
        row = order2.div(k, rounding_mode="floor")
        dim = flat.shape[1]
        x2 = torch.cat([x1[row, :dim], x1[:, dim:].reshape(-1)[order2, None]], 1)
        route2 = Route(self.group, send2, recv2)
        mine, flight = exchange(x2, route2)  # within the node
        flight.wait()
        per_expert = received[:, :local].view(n, per, local).sum(0)  # [forwarder, expert]
        out = self.run_experts(mine, per_expert, experts)
        back, flight = exchange(out, route2.reverse())
        flight.wait()
        summed = scatter_sum(back, row, x1.shape[0])  # a token's outputs on this node: one row
        back, flight = exchange(summed, route1.reverse())
        flight.wait()
        return scatter_sum(back, tok, t), shared

    def count_table(self, loads: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """[ep, local + 1 + L]: row q holds q's local experts' rows from here; for q this
        rank's peer on node h (same local index): the pairs sent to h and the rows it forwards
        to each of its node's L ranks."""
        n, per, local = self.n_nodes, self.per_node, self.local
        table = loads.new_zeros(self.ep, local + 1 + per)
        table[:, :local] = loads.view(self.ep, local)
        peers = torch.arange(n, device=loads.device) * per + self.lane
        table[peers, local] = pairs
        table[peers, local + 1 :] = loads.view(n, per, local).sum(-1)
        return table

    def sizes(self, table: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """[4, ep]: stage 1's send and receive sizes, stage 2's (zero off this node)."""
        n, per, local = self.n_nodes, self.per_node, self.local
        out = table.new_zeros(4, self.ep)
        out[0], out[1] = table[:, local], received[:, local]
        mine = slice(self.node * per, (self.node + 1) * per)
        out[2, mine] = received[:, local + 1 :].sum(0)
        out[3, mine] = received[:, :local].view(n, per, local).sum((0, 2))
        return out

    def balanced(self, tokens: int) -> list[list[int]]:
        """Perfect balance (the traced dry run): each token to topk_group nodes, an equal
        share to each; each forwarder sends its pairs' top_k choices evenly over its node."""
        n, per = self.n_nodes, self.per_node
        pairs, k = tokens * self.topk_group, self.top_k
        one = [pairs // n + (1 if h < pairs % n else 0) for h in range(n)]
        stage1 = [one[q // per] if q % per == self.lane else 0 for q in range(self.ep)]
        rows = tokens * k
        two = [rows // per + (1 if j < rows % per else 0) for j in range(per)]
        stage2 = [two[q % per] if q // per == self.node else 0 for q in range(self.ep)]
        return [stage1, list(stage1), stage2, list(stage2)]
