"""The plan under pipeline parallelism: what each pp rank holds, how many pipeline microbatches'
activations it keeps at once, its point-to-point volume and the schedule's bubble.

A pp rank holds the parameters (and gradients and optimizer state) of its stages only, and the
activations of its stages for every microbatch it has run forward but not yet backward. That
count depends on the schedule and on the rank (1F1B: the first stage keeps pp microbatches, the
last one; GPipe: all of them everywhere); `in_flight` gives it in stage-microbatches, from the
warm-up phase of each of torch's schedules. trainer/plan/memory.py plans every pp rank with
these and reports the largest.
"""

from __future__ import annotations

from trainer.parallel.pp_layout import (
    bubble_fraction,
    check_microbatches,
    check_pipeline,
    describe_split,
    rank_stages,
    stage_work,
)
from trainer.parallel.pp_layout import (
    schedule as find_schedule,
)


def layout(cfg) -> tuple[object, list, int]:
    """(the schedule, the stage specs, the pipeline microbatches per schedule step), the
    default split balanced by the units' work as train.py cuts it (`unit_weights`)."""
    par = cfg.parallelism
    sched = find_schedule(par.pipeline_parallel_schedule)
    args, weights = unit_weights(cfg)
    specs = check_pipeline(
        par, cfg.training, args.n_layers, args.tie_word_embeddings, cfg.model.flavor, weights
    )
    m = check_microbatches(par, cfg.training, sched, len(specs), par.pipeline_parallel_degree)
    return sched, specs, m


def unit_weights(cfg) -> tuple[object, list[float]]:
    """(the model's args as the plan builds it, the model FLOPs per token of each pipeline
    unit: trainer/models/flops.py `unit_flops`, the weights of the default split)."""
    from trainer.models.flops import unit_flops
    from trainer.plan.planned import plan_args, resolve_vocab

    args = plan_args(cfg, resolve_vocab(cfg)[0])
    return args, unit_flops(args, cfg.training.seq_len)


def rank_work(cfg) -> list[float]:
    """Each pp rank's model FLOPs (its stages' units) against an even share of the model's:
    what the split gives each rank before any repeated work (1.0 = its share)."""
    sched, specs, _ = layout(cfg)
    pp = cfg.parallelism.pipeline_parallel_degree
    weights = unit_weights(cfg)[1]
    work = stage_work(specs, weights)
    per_rank = [
        sum(work[s] for s in rank_stages(r, pp, len(specs), sched.style)) for r in range(pp)
    ]
    return [w * pp / sum(weights) for w in per_rank]


def rank_shape(cfg, rank: int) -> tuple:
    """What pp rank `rank` builds, up to the ranks' in-flight counts: its stages' units, each
    layer by its kind (trainer/models/flops.py `layer_kind`). Ranks of one shape do the
    same work per stage-microbatch; the trace runs one of them."""
    from trainer.models.flops import layer_kind

    sched, specs, _ = layout(cfg)
    args = unit_weights(cfg)[0]
    pp = cfg.parallelism.pipeline_parallel_degree
    return tuple(
        (specs[s].embedding, tuple(layer_kind(args, i) for i in specs[s].layers), specs[s].head)
        for s in rank_stages(rank, pp, len(specs), sched.style)
    )


def rank_units(cfg, rank: int) -> tuple[bool, list[int], bool]:
    """(holds the embedding, its layers, holds the head) of pp rank `rank`."""
    sched, specs, _ = layout(cfg)
    pp = cfg.parallelism.pipeline_parallel_degree
    mine = [specs[s] for s in rank_stages(rank, pp, len(specs), sched.style)]
    return (
        any(s.embedding for s in mine),
        [i for s in mine for i in s.layers],
        any(s.head for s in mine),
    )


def rank_groups(groups: dict, cfg, rank: int) -> dict:
    """The FSDP groups (trainer/plan/memory.py `fsdp_groups`) that pp rank `rank` holds."""
    embedding, layers, head = rank_units(cfg, rank)
    keep = (
        {f"layers.{i}" for i in layers}
        | ({"embedding"} if embedding else set())
        | ({"head"} if head else set())
    )
    return {k: v for k, v in groups.items() if k.removesuffix(".experts") in keep}


def in_flight(cfg, rank: int) -> float:
    """Pipeline microbatches whose activations (of all this rank's layers) rank `rank` keeps at
    its peak: the warm-up forwards of its schedule before the first backward, divided by its
    stages per rank (each stage-microbatch holds 1/v of the rank's layers)."""
    sched, specs, m = layout(cfg)
    pp = cfg.parallelism.pipeline_parallel_degree
    v = len(specs) // pp
    if sched.name in ("GPipe", "LoopedBFS"):  # every forward before any backward
        held = m * v
    elif sched.name == "1F1B":
        held = min(m, pp - rank)
    elif sched.style == "v":  # ZBV / DualPipeV: both stages' warm-up, ~2 pp stage-microbatches
        held = min(m * v, 2 * (pp - rank) + (1 if sched.name == "DualPipeV" else 0) + rank)
    else:  # interleaved: torch's warm-up, (v - 1) pp + 2 (pp - 1 - rank), then one more
        held = min(m * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1)
    return held / v


def p2p_bytes(cfg, p: int, rank: int, accum: int) -> int:
    """Bytes pp rank `rank` sends per optimizer step: each microbatch's activations forward
    across each stage boundary it owns the sending side of, and their gradients backward
    ([microbatch size, seq / (cp x tp), dim] in the compute dtype, p bytes each)."""
    from trainer.models.flavors import model_args

    sched, specs, m = layout(cfg)
    par, pp = cfg.parallelism, cfg.parallelism.pipeline_parallel_degree
    owner = {s: r for r in range(pp) for s in rank_stages(r, pp, len(specs), sched.style)}
    sends = sum(
        (s + 1 < len(specs) and owner[s + 1] != rank) + (s > 0 and owner[s - 1] != rank)
        for s in rank_stages(rank, pp, len(specs), sched.style)
    )
    dim = model_args(cfg.model.flavor).dim
    tokens = (
        par.pipeline_parallel_microbatch_size
        * cfg.training.seq_len
        // (par.context_parallel_degree * par.tensor_parallel_degree)
    )
    return sends * m * accum * p * tokens * dim


def summary(cfg, rank_totals: list[int], gib: int) -> list[str]:
    """The plan's pipeline lines: the schedule, the bubble and every rank's peak."""
    sched, specs, m = layout(cfg)
    pp = cfg.parallelism.pipeline_parallel_degree
    bubble = bubble_fraction(sched, pp, m, len(specs) // pp)
    peaks = ", ".join(f"{t / gib:.2f}" for t in rank_totals)
    work = ", ".join(f"{w:.3f}" for w in rank_work(cfg))
    return [
        f"pipeline: {sched.name}, {len(specs)} stages over pp {pp}, {m} microbatch(es) per "
        f"schedule step; ideal bubble {bubble:.1%} of the step ({sched.cost})",
        f"    {split_line(cfg, specs)}",
        f"    model FLOPs per pp rank, of an even share: {work}",
        f"    peak per pp rank (GiB): {peaks}; the table is rank "
        f"{max(range(pp), key=rank_totals.__getitem__)}'s",
    ]


def split_line(cfg, specs) -> str:
    """How the stages were cut (trainer/parallel/pp_layout.py `describe_split`)."""
    par = cfg.parallelism
    how = (
        f"at {', '.join(par.pipeline_parallel_split_points)} "
        "(parallelism.pipeline_parallel_split_points)"
        if par.pipeline_parallel_split_points
        else f"every {par.pipeline_parallel_layers_per_stage} units "
        "(parallelism.pipeline_parallel_layers_per_stage)"
        if par.pipeline_parallel_layers_per_stage
        else "balanced by model FLOPs"
    )
    return describe_split(specs, unit_weights(cfg)[1], how)
