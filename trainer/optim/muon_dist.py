"""Muon's Newton-Schulz on whole matrices when the parameters are sharded (FSDP/HSDP, TP, EP).

Per bucket of matrices on one mesh (trainer/optim/muon.py): each matrix gets one owner rank
(greedy by Newton-Schulz FLOPs, so every rank of the mesh does a balanced share); one
all-to-all sends every rank's shard of each update to the matrix's owner, which assembles the
whole matrix and orthogonalizes it; a second all-to-all sends each rank its shard of every
result. Per step a rank sends its local share of the updates (fp32) and receives its local
share of the results (in Newton-Schulz's dtype): ~6 bytes per local parameter, the minimum
for a whole-matrix Newton-Schulz, and no rank holds more than its own matrices whole.

Which part of a matrix a rank holds follows from the parameter's placements: each tensor dim
is cut, torch.chunk-wise, by the mesh dims that shard it, plain `Shard` ones outermost and
`_StridedShard` (FSDP's shard of a TP or EP shard) innermost; a `Replicate` dim (HSDP's
replicas) holds the same block, which its coordinate-0 replica sends. The block is checked
against the local tensor's shape. The all-to-alls run over one flat process group per mesh,
created when the optimizer is built, by every rank of the world in the same order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()


def _strided(p) -> bool:
    return bool(_StridedShard) and isinstance(p, _StridedShard)


def block(shape, placements, sizes, coord) -> tuple[slice, ...]:
    """The global index block of the rank at mesh coordinate `coord`."""
    ranges = [(0, n) for n in shape]
    for tdim in range(len(shape)):
        plain = [d for d, p in enumerate(placements)
                 if isinstance(p, Shard) and not _strided(p) and p.dim == tdim]
        inner = [d for d, p in enumerate(placements) if _strided(p) and p.dim == tdim]
        for d in plain + inner:
            lo, hi = ranges[tdim]
            n, k = hi - lo, sizes[d]
            step = -(-n // k)
            ranges[tdim] = (lo + min(coord[d] * step, n), lo + min((coord[d] + 1) * step, n))
    return tuple(slice(a, b) for a, b in ranges)


def _coords(index: int, sizes) -> tuple[int, ...]:
    out = []
    for s in reversed(sizes):
        out.append(index % s)
        index //= s
    return tuple(reversed(out))


def mesh_ranks(mesh) -> tuple[int, ...]:
    """The mesh's global ranks in row-major coordinate order (the mesh's tensor is real: read
    outside the traced dry run's fake mode, if any)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def flat_groups(meshes) -> dict[tuple[int, ...], object]:
    """{sorted mesh ranks: a process group over them} for each mesh of this rank's matrices.
    Every rank of the world takes part (new_group is collective): the meshes of every rank
    are gathered and the groups created in one sorted order. Under the traced dry run's fake
    process group, which has nothing to agree on, only this rank's."""
    mine = sorted({tuple(sorted(mesh_ranks(m))) for m in meshes})
    if dist.get_backend() == "fake":
        return {key: dist.new_group(list(key)) for key in mine}
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    out = {}
    for key in sorted({k for keys in seen for k in keys}):
        group = dist.new_group(list(key))
        if key in mine:
            out[key] = group
    return out


def ns_flops(shape, steps: int) -> float:
    """Newton-Schulz FLOPs of a parameter (each matrix of a stack): per iteration 2 m^2 n
    for the Gram matrix, 2 m^3 for its square, 2 m^2 n for the product (m <= n)."""
    m, n = sorted(shape[-2:])
    count = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return count * steps * (4 * m * m * n + 2 * m ** 3)


def owners(costs: list[float], ranks: int) -> list[int]:
    """Greedy: each matrix, largest first, to the least loaded rank (the same on every rank)."""
    load, owner = [0.0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + costs[i]
    return owner


class Layout:
    """Who holds which block of each matrix of a bucket, who owns it, and who sends it."""

    def __init__(self, params: list[DTensor], steps: int):
        mesh = params[0].device_mesh
        self.sizes = tuple(mesh.shape)
        self.ranks = mesh_ranks(mesh)
        self.world = len(self.ranks)
        self.me = self.ranks.index(dist.get_rank())
        # the collective's order is the group's (sorted global ranks), the blocks' the mesh's
        self.order = [self.ranks.index(r) for r in sorted(self.ranks)]
        self.shapes = [tuple(p.shape) for p in params]
        self.owner = owners([ns_flops(s, steps) for s in self.shapes], self.world)
        coords = [_coords(i, self.sizes) for i in range(self.world)]
        self.blocks = [[block(p.shape, p.placements, self.sizes, c) for c in coords]
                       for p in params]
        replicated = [[d for d, pl in enumerate(p.placements) if isinstance(pl, Replicate)]
                      for p in params]
        self.sends = [[all(coords[i][d] == 0 for d in rep) for i in range(self.world)]
                      for rep in replicated]
        for p, blocks in zip(params, self.blocks):
            want = tuple(s.stop - s.start for s in blocks[self.me])
            if want != tuple(p.to_local().shape):
                raise RuntimeError(f"Muon: the local shard of a {tuple(p.shape)} parameter "
                                   f"with placements {p.placements} is "
                                   f"{tuple(p.to_local().shape)}, not the block {want} its "
                                   "layout implies")

    def numel(self, m: int, i: int) -> int:
        return math.prod(s.stop - s.start for s in self.blocks[m][i])


def orthogonalize_sharded(updates: list[torch.Tensor], layout: Layout, group, fn,
                          dtype: torch.dtype) -> list[torch.Tensor]:
    """Each update (this rank's local shard, fp32) orthogonalized whole by `fn` on its owner;
    returns this rank's shards of the results, in `dtype`."""
    lay, me = layout, layout.me
    mine = [m for m in range(len(updates)) if lay.owner[m] == me]
    device = updates[0].device if updates else torch.device("cpu")
    # 1. every rank's shard of each update to the matrix's owner
    send = [[updates[m].reshape(-1) for m in range(len(updates))
             if lay.owner[m] == dest and lay.sends[m][me]] for dest in lay.order]
    recv_sizes = [sum(lay.numel(m, src) for m in mine if lay.sends[m][src])
                  for src in lay.order]
    received = _all_to_all(send, recv_sizes, torch.float32, device, group)
    results = {}
    for m in mine:
        full = torch.empty(lay.shapes[m], dtype=torch.float32, device=device)
        for k, src in enumerate(lay.order):
            if lay.sends[m][src]:
                n = lay.numel(m, src)
                blk = lay.blocks[m][src]
                full[blk] = received[k][:n].view(full[blk].shape)
                received[k] = received[k][n:]
        results[m] = fn(full)
    # 2. each rank's shard of every result back from the owners
    send = [[results[m][lay.blocks[m][dest]].reshape(-1) for m in mine]
            for dest in lay.order]
    recv_sizes = [sum(lay.numel(m, me) for m in range(len(updates)) if lay.owner[m] == src)
                  for src in lay.order]
    received = _all_to_all(send, recv_sizes, dtype, device, group)
    out: list = [None] * len(updates)
    for k, src in enumerate(lay.order):
        for m in range(len(updates)):
            if lay.owner[m] == src:
                n = lay.numel(m, me)
                out[m] = received[k][:n].view(updates[m].shape)
                received[k] = received[k][n:]
    return out


def _all_to_all(send: list[list[torch.Tensor]], recv_sizes: list[int], dtype, device,
                group) -> list[torch.Tensor]:
    """One all_to_all_single: `send[k]` (pieces, concatenated) to the group's rank k; returns
    what each rank k sent here, one flat tensor each."""
    pieces = [torch.cat([t.to(dtype) for t in s]) if s else
              torch.empty(0, dtype=dtype, device=device) for s in send]
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(out, torch.cat(pieces), output_split_sizes=recv_sizes,
                           input_split_sizes=[p.numel() for p in pieces], group=group)
    return list(out.split(recv_sizes))
