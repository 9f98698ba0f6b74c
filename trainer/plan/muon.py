"""Muon in the plan: the optimizer's own owner assignment (trainer/optim/muon_layout.py) run
over the meshes the trainer builds, for every rank of the world, without building anything.

Each Muon matrix becomes a `Spec` on the mesh its parameter lives on (trainer/parallel/):
- a matrix that TP splits (attention, a dense FFN): one mesh per pp stage,
  (dp_replicate, dp_shard x cp, tp), replicated over dp_replicate, cut by FSDP (rows) and tp;
- a MoE block's router and shared experts (TP leaves them whole) and, without ep, its
  stacked experts: one mesh per tp rank, (dp_replicate, dp_shard x cp), FSDP's rows;
- under ep the stacked experts: one mesh, (dp_replicate, efsdp x cp, ep), ep = ep_dp x tp
  (the tp ranks are in the ep group: trainer/parallel/dims.py), split over ep on dim 0 and
  over efsdp as `expert_placement` shards them (dim 0 when the local experts divide efsdp:
  whole where they live; else their width: gathered over efsdp).
With tp = 1 every matrix but the experts under ep is on the dp mesh, as in the trainer.
`ns_loads` gives each rank's Newton-Schulz FLOPs per step (matrices replicated over tp or
dp_replicate counted on every rank that computes them); `muon_volume` the bytes a rank sends.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Replicate, Shard

from trainer.optim.muon import takes_muon
from trainer.optim.muon_layout import MeshPlan, Spec, buckets
from trainer.plan.moe import block_id, tp_splits


def _stage_params(cfg, a, pp_rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, whole shape) of the Muon matrices pp rank `pp_rank` holds, in model order."""
    from trainer.models.build import build_model
    from trainer.plan.pipeline import rank_units

    embedding, layers, head = (
        rank_units(cfg, pp_rank)
        if cfg.parallelism.pipeline_parallel_degree > 1
        else (True, list(range(a.n_layers)), True)
    )
    out = []
    for name, p in build_model(a).named_parameters():
        if not takes_muon(name, p):
            continue
        i = block_id(name, a)
        if (i is not None and i < a.n_layers and i in layers) or (name.startswith("mtp.") and head):
            out.append((name, tuple(p.shape)))
    return out


def stage_meshes(cfg, pd, a, pp_rank: int) -> list[tuple[tuple, list[int], list[Spec]]]:
    """(mesh sizes, its ranks (row-major; the stage's ranks numbered from 0), its Muon specs
    in model order) for every mesh of one pp stage."""
    R, CP, TP, ep = pd.dp_replicate, pd.cp, pd.tp, pd.ep
    S, EPD = pd.dp_shard, pd.ep_dp  # dp_shard = (efsdp, ep_dp); ep = (ep_dp, tp) under ep
    F = S // EPD

    def rank(rep, s, c, t):
        return ((rep * S + s) * CP + c) * TP + t

    meshes: dict = {}

    def add(key, sizes, ranks, spec):
        meshes.setdefault(key, (sizes, ranks, []))[2].append(spec)

    dp_ranks = [
        [rank(r, s, c, t) for r in range(R) for s in range(S) for c in range(CP)] for t in range(TP)
    ]
    for name, shape in _stage_params(cfg, a, pp_rank):
        expert = len(shape) == 3
        if expert and ep > 1:
            local = shape[0] // ep
            dim = 0 if local % (F * CP) == 0 or shape[1] % (F * CP) else 1
            ranks = [
                rank(r, f * EPD + e, c, t)
                for r in range(R)
                for f in range(F)
                for c in range(CP)
                for e in range(EPD)
                for t in range(TP)
            ]
            add(
                "experts",
                (R, F * CP, ep),
                ranks,
                Spec(shape, (Replicate(), Shard(dim), Shard(0)), (R, F * CP, ep)),
            )
        elif TP > 1 and not expert and tp_splits(name, a):
            add(
                "tp",
                (R, S * CP, TP),
                list(range(R * S * CP * TP)),
                Spec(shape, (Replicate(), Shard(0), Shard(1)), (R, S * CP, TP)),
            )
        else:
            for t in range(TP):
                add(
                    ("dp", t),
                    (R, S * CP),
                    dp_ranks[t],
                    Spec(shape, (Replicate(), Shard(0)), (R, S * CP)),
                )
    return list(meshes.values())


def _assign(cfg, pd, a, pp_rank: int):
    """Each mesh of pp rank `pp_rank`'s stage with its plan and its ranks, and for each
    parameter of it, the view of the stage's first rank (global rank 0 of the stage): the
    owners as the optimizer assigns them, bucket by bucket."""
    out = []
    for sizes, ranks, specs in stage_meshes(cfg, pd, a, pp_rank):
        plan, views = MeshPlan(sizes, cfg.optimizer.muon_ns_steps), []
        me = ranks.index(0) if 0 in ranks else None
        for b in buckets([math.prod(s.shape) for s in specs], len(ranks)):
            views += zip([specs[i] for i in b], plan.assign([specs[i] for i in b], me), strict=True)
        out.append((ranks, plan, views if me is not None else []))
    return out


def ns_loads(cfg, pd, a) -> list[float]:
    """Newton-Schulz FLOPs per step of every rank of the world, from the optimizer's owner
    assignment (buckets in model order, the load carried over each mesh's buckets)."""
    per_stage = pd.dp_replicate * pd.dp_shard * pd.cp * pd.tp
    loads = [0.0] * (per_stage * pd.pp)
    for pp_rank in range(pd.pp):
        for ranks, plan, _ in _assign(cfg, pd, a, pp_rank):
            for i, r in enumerate(ranks):
                loads[pp_rank * per_stage + r] += plan.load[i]
    return loads


def muon_volume(cfg, pd, a, pp_rank: int = 0) -> float:
    """Bytes the first rank of pp rank `pp_rank` sends per step in Muon's all-to-alls, under
    the optimizer's owners: for each unit gathered over n ranks, its piece (1/n) to the owner,
    or as the owner the others' pieces of the result, both in muon_ns_dtype. Units held whole
    send nothing."""
    r = 2 if cfg.optimizer.muon_ns_dtype == "bfloat16" else 4
    total = 0.0
    for ranks, _, views in _assign(cfg, pd, a, pp_rank):
        me = ranks.index(0) if views else None
        for spec, view in views:
            n = len(view.group)
            unit = math.prod(spec.shape[-2:])
            for u in view.units if n > 1 else ():
                total += r * unit * (n - 1) / n if view.owner[u] == me else r * unit / n
    return total
