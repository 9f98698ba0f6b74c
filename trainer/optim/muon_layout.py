"""Who orthogonalizes which matrix under Muon: the unit of work, the group that gathers it, its
owner. Pure arithmetic on shapes and placements (no process group), so that the optimizer
(trainer/optim/muon_dist.py) and the plan (trainer/plan/muon.py) count the same assignment.

- **Unit**: one matrix. A 2-D parameter is one; a stacked `[E, out, in]` expert tensor is E,
  never one unit of `E x out` rows.
- **Gather dims** of a parameter: the mesh dims (of size > 1) that cut one of its last two
  dims (FSDP's row shard, TP's row or column shard, FSDP's `Shard(1)` of experts). A unit is
  gathered only over them: the ranks that differ from this one in those coordinates only (its
  *gather group*) hold the pieces of the same units. No gather dim: every rank holding a unit
  holds it whole (experts split over ep and efsdp on dim 0) and orthogonalizes it where it
  lives, with no transfer. `Replicate` dims (HSDP replicas) are never gather dims: each
  replica's group computes the same result from the same data.
- **Owner** of a gathered unit: the least loaded rank of its gather group (Newton-Schulz
  FLOPs), units largest first; the load is carried over the buckets of one mesh (`MeshPlan`),
  not reset per bucket. Units held whole add their FLOPs to every rank holding them.
Every rank of a mesh runs the same arithmetic for the whole mesh, so all agree on the owners
without a message.
"""

from __future__ import annotations

import dataclasses
import math

from torch.distributed.tensor.placement_types import Shard

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()

BUCKET_BYTES = 512 * 2**20  # per rank: fp32 bytes of whole matrices one bucket spreads


def _strided(p) -> bool:
    return bool(_StridedShard) and isinstance(p, _StridedShard)


def block(shape, placements, sizes, coord) -> tuple[slice, ...]:
    """The global index block of the rank at mesh coordinate `coord`: each tensor dim cut,
    torch.chunk-wise, by the mesh dims that shard it, plain `Shard` ones outermost and
    `_StridedShard` (FSDP's shard of a TP or EP shard) innermost."""
    ranges = [(0, n) for n in shape]
    for tdim in range(len(shape)):
        plain = [
            d
            for d, p in enumerate(placements)
            if isinstance(p, Shard) and not _strided(p) and p.dim == tdim
        ]
        inner = [d for d, p in enumerate(placements) if _strided(p) and p.dim == tdim]
        for d in plain + inner:
            lo, hi = ranges[tdim]
            n, k = hi - lo, sizes[d]
            step = -(-n // k)
            ranges[tdim] = (lo + min(coord[d] * step, n), lo + min((coord[d] + 1) * step, n))
    return tuple(slice(a, b) for a, b in ranges)


def coords(index: int, sizes) -> tuple[int, ...]:
    """The mesh coordinate of row-major index `index`."""
    out = []
    for s in reversed(sizes):
        out.append(index % s)
        index //= s
    return tuple(reversed(out))


def ns_flops(shape, steps: int) -> float:
    """Newton-Schulz FLOPs of a parameter (each matrix of a stack): per iteration 2 m^2 n
    for the Gram matrix, 2 m^3 for its square, 2 m^2 n for the product (m <= n)."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m**3)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the assignment needs of a parameter: its global shape and its placements on a
    mesh of `sizes`."""

    shape: tuple[int, ...]
    placements: tuple
    sizes: tuple[int, ...]

    @property
    def gather_dims(self) -> tuple[int, ...]:
        nd = len(self.shape)
        return tuple(
            d
            for d, p in enumerate(self.placements)
            if self.sizes[d] > 1 and (isinstance(p, Shard) or _strided(p)) and p.dim >= nd - 2
        )

    @property
    def unit_flops(self) -> float:
        return ns_flops(self.shape[-2:], 1)

    def units(self, coord) -> range:
        """The units (leading indices) the rank at `coord` holds a piece of."""
        if len(self.shape) == 2:
            return range(1)
        if len(self.shape) != 3:
            raise ValueError(f"Muon takes matrices or [E, out, in] stacks, not {self.shape}")
        rows = block(self.shape, self.placements, self.sizes, coord)[0]
        return range(rows.start, rows.stop)


@dataclasses.dataclass
class Assigned:
    """One parameter of a bucket, seen from the rank at mesh index `me`: its gather group
    (mesh indices, row-major; empty: its units are whole here), the units the group holds,
    and each unit's owner (a mesh index)."""

    group: tuple[int, ...]
    units: range
    owner: dict[int, int]


def gather_group(spec: Spec, me: int) -> tuple[int, ...]:
    """The mesh indices that differ from `me` only in the spec's gather dims."""
    dims = spec.gather_dims
    if not dims:
        return ()
    mine = coords(me, spec.sizes)
    return tuple(
        i
        for i in range(math.prod(spec.sizes))
        if all(c == mine[d] for d, c in enumerate(coords(i, spec.sizes)) if d not in dims)
    )


class MeshPlan:
    """The owners of the units of one mesh's parameters, bucket after bucket, with every
    rank's Newton-Schulz load (`load`, FLOPs per step; `steps` Newton-Schulz iterations)
    carried from one bucket to the next."""

    def __init__(self, sizes, steps: int):
        self.sizes = tuple(sizes)
        self.steps = steps
        self.load = [0.0] * math.prod(self.sizes)
        self._cache: dict = {}

    def _groups(self, spec: Spec) -> list[tuple[int, ...]]:
        """Every gather group of the mesh (each rank alone when there is no gather dim)."""
        dims = spec.gather_dims
        if dims not in self._cache:
            groups: dict = {}
            for i in range(len(self.load)):
                c = coords(i, self.sizes)
                key = tuple(x for d, x in enumerate(c) if d not in dims)
                groups.setdefault(key, []).append(i)
            self._cache[dims] = [tuple(g) for g in groups.values()]
        return self._cache[dims]

    def assign(self, specs: list[Spec], me: int | None = None) -> list[Assigned | None]:
        """Owners of every unit of a bucket over the whole mesh (the loads of every rank
        change); returns rank `me`'s view of each parameter (None when `me` is None)."""
        out: list = [None] * len(specs)
        for m in sorted(range(len(specs)), key=lambda m: (-specs[m].unit_flops, m)):
            spec = specs[m]
            cost = spec.unit_flops * self.steps
            for members in self._groups(spec):
                units = spec.units(coords(members[0], self.sizes))
                owner = {}
                if len(members) == 1:  # whole here
                    self.load[members[0]] += cost * len(units)
                else:
                    for u in units:
                        r = min(members, key=lambda i: (self.load[i], i))
                        self.load[r] += cost
                        owner[u] = r
                if me is not None and me in members:
                    out[m] = Assigned(members if len(members) > 1 else (), units, owner)
        return out


def buckets(numels: list[int], world: int, budget: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of one mesh's parameters in buckets of ~`budget` fp32 bytes of whole
    matrices per rank of the mesh (`world` ranks; at least one parameter each)."""
    out, bucket, size = [], [], 0
    for i, n in enumerate(numels):
        bucket.append(i)
        size += 4 * n
        if size >= budget * world:
            out.append(bucket)
            bucket, size = [], 0
    return out + ([bucket] if bucket else [])
