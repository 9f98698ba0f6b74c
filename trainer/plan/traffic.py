"""The bytes a rank sends, counted in the traced dry run, per mesh dimension.

Every collective of a traced step reaches the fake mode (trainer/plan/fake.py) as a `c10d` op
(FSDP2's all-gathers and reduce-scatters, the step's all-reduces, expert parallelism's
all-to-all) or a `_c10d_functional` op (DTensor's redistributions under TP and the loss's
all-reduces), on this rank's fake local tensors and naming its process group. `Traffic`
books each one to the mesh dimension of its group with the bytes rank 0 sends under a
bandwidth-optimal algorithm, as trainer/plan/comm.py counts them for the plan:

    all-gather: (n - 1) x the input        reduce-scatter: (n - 1) / n x the input
    all-reduce: 2 (n - 1) / n x the tensor  all-to-all: the rows sent to the other ranks
    send: the tensor                        broadcast: the tensor, from its root

Each dimension's bytes to ranks on other nodes are booked apart as well (`dim@internode`,
`internode_bytes`: exact for all-to-alls, a ring's share otherwise), for `--json`'s
`trace.internode_bytes`.

The trace runs one or two of a step's microbatches (trainer/plan/trace.py); `per_step` scales
them to the step's `accum` as the loop would run them. A dimension where the rank sends more
than the plan says (by 15%, and at least 1 MiB) gets a warning naming it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from trainer.health import heartbeat

COMM_NAMESPACES = ("c10d", "_c10d_functional")
DIMS = ("tp", "cp", "dp_shard", "dp_replicate", "ep", "pp")
# the mesh dimensions' and flattened meshes' names, as the plan groups them (FSDP shards over
# dp_shard (x cp), experts over efsdp: both the plan's dp_shard; `dp` carries the loss's and
# the token count's scalars)
LABELS = {
    "dp_shard_cp": "dp_shard",
    "efsdp": "dp_shard",
    "efsdp_cp": "dp_shard",
    "dp": "dp_shard",
    "cp_tp": "cp",
}
MIB = 2**20
INTERNODE = "@internode"  # a dimension's label + this: its bytes to ranks on other nodes
STEP_PHASES = ("tp_grads", "clip", "optimizer")  # once per step, after the microbatches

# op name -> (kind, the argument holding what this rank sends)
OPS = {
    "all_gather_into_tensor": ("gather", 0),
    "all_gather_into_tensor_out": ("gather", 0),
    "all_gather_into_tensor_coalesced": ("gather", 0),
    "_allgather_base_": ("gather", 1),
    "allgather_": ("gather", 1),
    "allgather_coalesced_": ("gather", 1),
    "allgather_into_tensor_coalesced_": ("gather", 1),
    "reduce_scatter_tensor": ("scatter", 0),
    "reduce_scatter_tensor_out": ("scatter", 0),
    "reduce_scatter_tensor_coalesced": ("scatter", 0),
    "_reduce_scatter_base_": ("scatter", 1),
    "reduce_scatter_": ("scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("scatter", 1),
    "all_reduce": ("reduce", 0),
    "all_reduce_": ("reduce", 0),
    "all_reduce_coalesced": ("reduce", 0),
    "all_reduce_coalesced_": ("reduce", 0),
    "allreduce_": ("reduce", 0),
    "allreduce_coalesced_": ("reduce", 0),
    "all_to_all_single": ("a2a", 0),
    "alltoall_base_": ("a2a", 1),
    "alltoall_": ("a2a", 1),
    "send": ("send", 0),
    "isend": ("send", 0),
    "broadcast_": ("broadcast", 0),
    "broadcast": ("broadcast", 0),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group(args):
    """The op's process group: a ProcessGroup script object (c10d) or a name (functional)."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a)
    for a in reversed(args):
        if isinstance(a, str) and not a.startswith(("sum", "avg", "max", "min", "product")):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                return _resolve_process_group(a)
            except (KeyError, ValueError, RuntimeError):
                continue
    return None


def _own(args) -> int:
    """This rank's index in the op's group (0 when it cannot tell)."""
    group = _group(args)
    if group is None or not dist.is_initialized():
        return 0
    ranks = dist.get_process_group_ranks(group)
    return ranks.index(dist.get_rank()) if dist.get_rank() in ranks else 0


def sent_bytes(name: str, args, n: int) -> float:
    """What rank 0 (the first rank of each of its groups) sends in op `name` over n ranks."""
    kind, index = OPS[name]
    b = _nbytes(args[index])
    if kind == "gather":
        return (n - 1) * b
    if kind == "scatter":
        return (n - 1) / n * b
    if kind == "reduce":
        return 2 * (n - 1) / n * b
    if kind == "a2a":
        splits = {"all_to_all_single": 2, "alltoall_base_": 4}.get(name)
        sizes = list(args[splits]) if splits is not None else []
        if sizes and sum(sizes) > 0:  # all but this rank's own rows
            return b * (1 - sizes[_own(args)] / sum(sizes))
        if name == "alltoall_":
            return b - _nbytes(args[index][0])
        return (n - 1) / n * b
    if kind == "broadcast":
        root = args[2] if name == "broadcast_" else args[1]
        return float(b) if root == 0 else 0.0
    return float(b)  # send


def internode_bytes(name: str, args, group, sent: float) -> float:
    """Of the `sent` bytes of op `name` over `group`, those to ranks on other nodes (ranks
    per node: LOCAL_WORLD_SIZE, which the plan sets from --ngpu; torchrun's ranks fill nodes in
    order). An all-to-all: exactly, from its split sizes (this rank's row to each
    destination); any other collective: a bandwidth-optimal ring over the group in rank order
    crosses nodes on as many of its n edges as the group spans nodes, so that fraction."""
    import os

    per = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    ranks = dist.get_process_group_ranks(group)
    if not per or not sent:
        return 0.0
    nodes = [r // per for r in ranks]
    if len(set(nodes)) == 1:
        return 0.0
    kind, index = OPS[name]
    me = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else 0
    if kind == "a2a":
        splits = {"all_to_all_single": 2, "alltoall_base_": 4}.get(name)
        sizes = list(args[splits]) if splits is not None else []
        if not sizes or sum(sizes) == 0:
            sizes = [1] * len(ranks)
        away = sum(n for n, node in zip(sizes, nodes, strict=True) if node != nodes[me])
        return _nbytes(args[index]) * away / sum(sizes)
    return sent * len(set(nodes)) / len(ranks)


class Traffic:
    """The books: bytes by (segment, dimension). A segment is the microbatch the loop is in
    (1, 2, ...: each forward's `heartbeat.phase("forward")`), or "step" for what the step
    does once (clipping, the optimizer)."""

    def __init__(self, pd):
        self.names = group_labels(pd)
        self.segment: int | str = 0
        self.bytes: dict = {}
        self.unknown: dict[str, int] = {}

    @contextlib.contextmanager
    def segments(self):
        """Count the microbatches as the loops announce their forwards."""
        original = heartbeat.phase

        def phase(name, *args, **kwargs):
            if name == "forward" and isinstance(self.segment, int):
                self.segment += 1
            return original(name, *args, **kwargs)

        heartbeat.phase = phase
        try:
            yield
        finally:
            heartbeat.phase = original

    def record(self, func, args) -> None:
        name = func._schema.name.split("::")[-1]
        if name not in OPS:
            if name not in (
                "wait_tensor",
                "barrier",
                "recv_",
                "irecv",
                "_wrap_tensor_autograd",
                "check_for_nan",
                "monitored_barrier_",
            ):
                self.unknown[name] = self.unknown.get(name, 0) + 1
            return
        group = _group(args)
        n = group.size() if group is not None else 1
        if n == 1:
            return
        label = self.names.get(group.group_name, "other")
        sent = sent_bytes(name, args, n)
        self.add(label, sent, OPS[name][0])
        crossing = internode_bytes(name, args, group, sent)
        if crossing:
            self.add(label + INTERNODE, crossing, OPS[name][0])

    def add(self, label: str, nbytes: float, kind: str = "send") -> None:
        seg = "step" if heartbeat._state["phase"] in STEP_PHASES else self.segment
        books = self.bytes.setdefault(seg, {})
        books[label, kind] = books.get((label, kind), 0.0) + nbytes

    def per_step(self, accum: int, traced: int, once=()) -> dict[str, float]:
        """Bytes per optimizer step by dimension: the `traced` microbatches (1: the step's
        last, every earlier one like it but for the dimensions in `once`, which reduce once per
        step; 2: the first stands for the `accum - 1` that keep their gradients, the second
        reduces them) and the step's own traffic."""
        out = dict.fromkeys(DIMS, 0.0)
        for seg, books in self.bytes.items():
            for (label, _), b in books.items():
                w = (
                    1
                    if seg == "step" or label.removesuffix(INTERNODE) in once
                    else (accum if traced == 1 else accum - 1 if seg == 1 else 1)
                )
                out[label] = out.get(label, 0.0) + w * b
        return out


def group_labels(pd) -> dict[str, str]:
    """{process group name: the plan's dimension} for every mesh group of `pd`."""
    names = {}
    mesh = pd.world_mesh
    for dim in mesh.mesh_dim_names:
        names[mesh[dim].get_group().group_name] = LABELS.get(dim, dim)
    for flat, dim in (
        (pd.dp_mesh, "dp"),
        (pd._shard_mesh, "dp_shard"),
        (getattr(pd, "_expert_mesh", None), "efsdp_cp"),
        (getattr(pd, "_ep_mesh", None), "ep"),  # ep_dp x tp flattened
        (getattr(pd, "_cp_tp", None), "cp_tp"),
    ):
        if flat is not None:
            names.setdefault(flat.get_group().group_name, LABELS.get(dim, dim))
    names.setdefault(dist.group.WORLD.group_name, "world")
    return names


def size(b: float) -> str:
    return f"{b / 2**30:.3f} GiB" if b >= 2**30 else f"{b / MIB:.2f} MiB"


def traffic_lines(
    traced: dict[str, float], plan: dict[str, float], who: str = "rank 0"
) -> list[str]:
    """The trace's bytes per step beside the plan's, and a warning per dimension where the
    rank sends more than the plan says."""
    dims = [d for d in (*DIMS, "optimizer", "world", "other") if traced.get(d) or plan.get(d)]
    if not dims:
        return [f"  traffic: {who} sends nothing (one rank)"]
    lines = [
        f"  traffic per optimizer step, {who} sends (traced / plan): "
        + ", ".join(f"{d} {size(traced.get(d, 0.0))} / {size(plan.get(d, 0.0))}" for d in dims)
    ]
    for d in dims:
        t, p = traced.get(d, 0.0), plan.get(d, 0.0)
        if t > 1.15 * p and t - p > MIB:
            lines.append(
                f"  warning: {who} sends {size(t)} over {d} per step, "
                f"{t / max(p, 1.0):.2f}x the plan's {size(p)}: traffic the "
                "layout repeats or the plan misses (trainer/plan/traffic.py)"
            )
    return lines
