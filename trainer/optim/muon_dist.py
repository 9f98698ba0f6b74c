"""Muon's Newton-Schulz on whole matrices when the parameters are sharded (FSDP/HSDP, TP, EP).

Per bucket of one mesh's parameters, the units (one matrix each; an expert of a stack is one)
and their owners come from trainer/optim/muon_layout.py. A unit held whole here (experts split
over ep and efsdp on dim 0, any matrix on one rank) is orthogonalized in place, no transfer. A
unit cut over gather dims is gathered within its gather group only (the efsdp ranks of an
expert cut on its width; the dp_shard x tp ranks of a dense matrix): one all-to-all per group
sends every rank's pieces to the units' owners, which assemble and orthogonalize them; a second
sends each rank its pieces of the results. Both travel in Newton-Schulz's dtype (the owner's
first step is the cast to it, so a piece cast before it travels gives the same bits): per step
a rank sends ~(2 + 2) bytes per local gathered parameter in bf16 and receives as much.
Same-shape matrices are orthogonalized in one batched matmul chain (`orthogonalize`).

The transfers are asynchronous (`all_to_all_single(async_op=True)`): bucket k + 1's pieces
travel while bucket k is orthogonalized, and bucket k's results come back while bucket k + 1
is (`Muon._muon_step`). The process groups (one per gather group) are created when the
optimizer is built, by every rank of the world in the same order; there every rank checks its
layout (the block each local shard should be) and a mismatch on any rank stops every rank with
one config line, before any collective of a step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainer.errors import ConfigError
from trainer.optim.muon_layout import Assigned, Spec, block, coords, gather_group
from trainer.optim.newton_schulz import orthogonalize


def mesh_ranks(mesh) -> tuple[int, ...]:
    """The mesh's global ranks in row-major coordinate order (the mesh's tensor is real: read
    outside the traced dry run's fake mode, if any)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def spec_of(p) -> tuple[Spec, tuple[int, ...]]:
    """(the assignment's view of parameter `p`, its mesh's global ranks); a plain tensor is
    on a mesh of one rank."""
    if hasattr(p, "device_mesh"):
        return (
            Spec(tuple(p.shape), tuple(p.placements), tuple(p.device_mesh.shape)),
            mesh_ranks(p.device_mesh),
        )
    return Spec(tuple(p.shape), (), ()), (dist.get_rank() if dist.is_initialized() else 0,)


def layout_error(name: str, p) -> str | None:
    """Why parameter `p`'s local shard is not the block its placements imply, or None."""
    if not hasattr(p, "device_mesh"):
        return None
    spec, ranks = spec_of(p)
    me = coords(ranks.index(dist.get_rank()), spec.sizes)
    want = tuple(s.stop - s.start for s in block(spec.shape, spec.placements, spec.sizes, me))
    got = tuple(p.to_local().shape)
    if want == got:
        return None
    return (
        f"Muon cannot orthogonalize {name} on rank {dist.get_rank()}: its local shard is "
        f"{got}, not the block {want} its placements {tuple(p.placements)} imply; train it "
        "with optimizer.name = 'AdamW', or use a layout Muon reads (FSDP/HSDP, TP, EP)"
    )


def process_groups(named_params) -> dict[tuple[int, ...], object]:
    """{sorted global ranks: a process group} for the gather groups of this rank's
    parameters, after every rank has checked its layout (`layout_error`): a mismatch on any
    rank raises the same ConfigError on every rank. Every rank of the world takes part
    (new_group is collective): the groups are gathered and created in one sorted order. Under
    the traced dry run's fake process group, which has nothing to agree on, only this rank's."""
    errors, mine = [], set()
    for name, p in named_params:
        if (err := layout_error(name, p)) is not None:
            errors.append(err)
            continue
        spec, ranks = spec_of(p)
        group = gather_group(spec, ranks.index(dist.get_rank()))
        if group:
            mine.add(tuple(sorted(ranks[i] for i in group)))
    if dist.get_backend() == "fake":
        if errors:
            raise ConfigError(errors[0])
        return {key: dist.new_group(list(key)) for key in sorted(mine)}
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (sorted(mine), errors[:1]))
    for _, errs in seen:
        if errs:
            raise ConfigError(errs[0])
    return {
        key: group
        for key in sorted({k for keys, _ in seen for k in keys})
        for group in [dist.new_group(list(key))]
        if key in mine
    }


class Layout:
    """A bucket of one mesh's parameters as this rank sees it: for each, its units' owners
    (`Assigned`) and the matrix block (rows, cols) each rank of its gather group holds."""

    def __init__(self, params, assigned: list[Assigned], ranks: tuple[int, ...], groups):
        self.params, self.assigned, self.ranks = params, assigned, ranks
        self.me = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
        spec = [spec_of(p)[0] for p in params]
        self.shapes = [s.shape[-2:] for s in spec]
        self.blocks = [
            {i: block(s.shape, s.placements, s.sizes, coords(i, s.sizes))[-2:] for i in a.group}
            for s, a in zip(spec, assigned, strict=True)
        ]
        self.local = [m for m, a in enumerate(assigned) if not a.group]
        by_group: dict = {}
        for m, a in enumerate(assigned):
            if a.group:
                by_group.setdefault(a.group, []).append(m)
        # each gather group: (its members in the collective's order, its process group,
        # its items (param, unit) in one order on every member)
        self.exchanges = []
        for members, ms in sorted(by_group.items()):
            order = sorted(members, key=lambda i: ranks[i])
            key = tuple(sorted(ranks[i] for i in members))
            items = [(m, u) for m in ms for u in assigned[m].units]
            self.exchanges.append((order, groups[key], items))

    def piece(self, m: int, i: int) -> tuple[slice, slice]:
        return self.blocks[m][i]

    def numel(self, m: int, i: int) -> int:
        return math.prod(s.stop - s.start for s in self.blocks[m][i])

    def mine(self, m: int, u: int, t: torch.Tensor) -> torch.Tensor:
        """This rank's piece of unit `u` of parameter `m` in its local tensor `t`."""
        return t if t.ndim == 2 else t[u - self.assigned[m].units.start]


def _launch(send: list[list[torch.Tensor]], recv_sizes: list[int], dtype, device, group):
    """An asynchronous all_to_all_single: `send[k]` (pieces, concatenated) to the group's rank
    k; returns (its work, the flat output, the sizes received from each rank)."""
    pieces = [
        torch.cat([t.reshape(-1).to(dtype) for t in s])
        if s
        else torch.empty(0, dtype=dtype, device=device)
        for s in send
    ]
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    work = dist.all_to_all_single(
        out,
        torch.cat(pieces),
        output_split_sizes=recv_sizes,
        input_split_sizes=[p.numel() for p in pieces],
        group=group,
        async_op=True,
    )
    return work, out, recv_sizes


def send_pieces(layout: Layout, updates: list[torch.Tensor], dtype: torch.dtype) -> list:
    """Start bucket's first transfers: every rank's pieces of each gathered unit to its owner,
    in Newton-Schulz's `dtype` (the owner's first step casts the unit to it, element by
    element: bitwise the same result, and in bf16 half the bytes of fp32). Returns the works
    in flight, one per gather group."""
    lay, me, out = layout, layout.me, []
    device = updates[0].device
    for order, group, items in lay.exchanges:
        owner = {(m, u): lay.assigned[m].owner[u] for m, u in items}
        send = [
            [lay.mine(m, u, updates[m]) for m, u in items if owner[m, u] == dest] for dest in order
        ]
        recv = [sum(lay.numel(m, src) for m, u in items if owner[m, u] == me) for src in order]
        out.append(_launch(send, recv, dtype, device, group))
    return out


def orthogonalize_bucket(
    layout: Layout, updates, inflight, steps: int, dtype: torch.dtype
) -> tuple[list, dict]:
    """Wait for the bucket's pieces, orthogonalize the owned and the local units (Newton-Schulz
    of `steps` in `dtype`, same shapes batched), and start the results' way back. Returns (the
    works in flight, {param: its local result} for the units held whole here)."""
    lay, me, back = layout, layout.me, []
    local = batched([updates[m] for m in lay.local], steps, dtype)
    for (order, group, items), (work, flat, sizes) in zip(lay.exchanges, inflight, strict=True):
        work.wait()
        received = list(flat.split(sizes))
        owned = [(m, u) for m, u in items if lay.assigned[m].owner[u] == me]
        full = {
            mu: torch.empty(lay.shapes[mu[0]], dtype=flat.dtype, device=flat.device) for mu in owned
        }
        for k, src in enumerate(order):
            offset = 0
            for mu in owned:
                n = lay.numel(mu[0], src)
                rows, cols = lay.piece(mu[0], src)
                full[mu][rows, cols] = received[k][offset : offset + n].view(
                    rows.stop - rows.start, cols.stop - cols.start
                )
                offset += n
        done = dict(zip(owned, batched([full[mu] for mu in owned], steps, dtype), strict=True))
        del full, received
        send = [[done[mu][lay.piece(mu[0], dest)] for mu in owned] for dest in order]
        recv = [
            sum(lay.numel(m, me) for m, u in items if lay.assigned[m].owner[u] == src)
            for src in order
        ]
        back.append(_launch(send, recv, dtype, flat.device, group))
    return back, dict(zip(lay.local, local, strict=True))


def receive_results(layout: Layout, back) -> dict[int, torch.Tensor]:
    """Wait for the results' pieces; {param: this rank's shard of its result}."""
    lay, me, out = layout, layout.me, {}
    for (order, _, items), (work, flat, sizes) in zip(lay.exchanges, back, strict=True):
        work.wait()
        received = list(flat.split(sizes))
        for m in {m for m, _ in items}:
            out[m] = torch.empty(
                layout.params[m].to_local().shape, dtype=flat.dtype, device=flat.device
            )
        for k, src in enumerate(order):
            offset = 0
            for m, u in items:
                if lay.assigned[m].owner[u] == src:
                    n = lay.numel(m, me)
                    target = lay.mine(m, u, out[m])
                    target.copy_(received[k][offset : offset + n].view(target.shape))
                    offset += n
    return out


def batched(mats: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Newton-Schulz of each matrix or stack of `mats`, same-shape matrices in one batch (cast
    to `dtype` before they are stacked): one result each, in `dtype`."""
    by_shape: dict = {}
    for k, t in enumerate(mats):
        by_shape.setdefault(tuple(t.shape[-2:]), []).append(k)
    out: list = [None] * len(mats)
    for shape, ks in by_shape.items():
        full = [k for k in ks if mats[k].numel()]
        for k in set(ks) - set(full):
            out[k] = torch.empty(mats[k].shape, dtype=dtype, device=mats[k].device)
        if len(full) == 1:
            out[full[0]] = orthogonalize(mats[full[0]], steps, dtype)
        elif full:
            counts = [math.prod(mats[k].shape[:-2]) for k in full]
            stacked = torch.cat([mats[k].reshape(-1, *shape).to(dtype) for k in full])
            for k, r in zip(full, orthogonalize(stacked, steps, dtype).split(counts), strict=True):
                out[k] = r.view(mats[k].shape)
    return out
