"""Pipeline parallelism's layout, without torch: the schedules, how the model is cut into
stages, which rank holds which stage, and the checks a config must pass before any rank starts.

A model is a row of units: the token embedding, the n transformer layers, then the final norm
with the output head (and the loss). A stage is a contiguous run of units. The default split
balances the stages' work: each unit weighs its model FLOPs per token (trainer/models/flops.py
`unit_flops`: the embedding, a lookup, ~0; the head its matmul, e.g. 1.06 layers of Llama 3
70B; a DeepSeek dense layer less than a MoE one), the heaviest stage is made as light as any
contiguous cut allows, and the stages share what is left as evenly as that permits.
Stage s lives on pp rank `stage_rank(s)`: s mod pp for the looped schedules (one stage per
rank, or several "virtual" stages per rank for the interleaved ones), the V shape for ZBV and
DualPipeV (rank r holds stages r and 2 pp - 1 - r, so the first and the last stage share a
rank).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from trainer.errors import ConfigError

PP_KEY = "parallelism.pipeline_parallel_degree"
SCHEDULE_KEY = "parallelism.pipeline_parallel_schedule"
MICROBATCH_KEY = "parallelism.pipeline_parallel_microbatch_size"
LAYERS_KEY = "parallelism.pipeline_parallel_layers_per_stage"
SPLIT_KEY = "parallelism.pipeline_parallel_split_points"


@dataclass(frozen=True)
class Schedule:
    name: str  # torch.distributed.pipelining's name
    stages_per_rank: int | None  # 1, exactly 2 (V), or None: any number >= 2 (interleaved)
    style: str  # "loop": stage s on rank s % pp; "v": the V shape
    min_microbatches: str  # "none", "pp" (>= pp) or "stages" (>= the number of stages)
    cost: str  # one line for docs/parallelism.md and the plan
    split_backward: bool = False  # input and weight gradients in separate passes (zero bubble)


SCHEDULES = {
    s.name: s
    for s in (
        Schedule(
            "GPipe",
            1,
            "loop",
            "none",
            "all forwards, then all backwards: every microbatch's activations live at once",
        ),
        Schedule(
            "1F1B",
            1,
            "loop",
            "stages",
            "one forward, one backward: at most pp microbatches' activations per rank",
        ),
        Schedule(
            "Interleaved1F1B",
            None,
            "loop",
            "none",
            "1F1B over v virtual stages per rank: the bubble shrinks by v, p2p grows by v",
        ),
        Schedule(
            "LoopedBFS",
            None,
            "loop",
            "none",
            "breadth-first over virtual stages: each stage's microbatches in a row",
        ),
        Schedule(
            "InterleavedZeroBubble",
            None,
            "loop",
            "none",
            "interleaved, with the weight gradients deferred to fill the bubble",
            True,
        ),
        Schedule(
            "ZBVZeroBubble",
            2,
            "v",
            "none",
            "two stages per rank in a V, weight gradients deferred: near-zero bubble",
            True,
        ),
        Schedule(
            "DualPipeV",
            2,
            "v",
            "stages",
            "DeepSeek's DualPipe on a V: forward and backward of two microbatches overlap",
            True,
        ),
    )
}


def schedule(name: str) -> Schedule:
    """The schedule called `name` (case-insensitive), or a ConfigError listing the valid ones."""
    for known in SCHEDULES.values():
        if known.name.lower() == name.lower():
            return known
    raise ConfigError(f"{SCHEDULE_KEY} = {name!r} is not a schedule; valid: {', '.join(SCHEDULES)}")


@dataclass(frozen=True)
class StageSpec:
    index: int
    embedding: bool  # holds the token embedding (the first stage)
    layers: tuple[int, ...]  # the transformer layers, in order
    head: bool  # holds the final norm, the output head and the loss (the last stage)

    def describe(self) -> str:
        parts = (
            (["embedding"] if self.embedding else [])
            + (
                [
                    f"layers {self.layers[0]}-{self.layers[-1]}"
                    if len(self.layers) > 1
                    else f"layer {self.layers[0]}"
                ]
                if self.layers
                else []
            )
            + (["norm+head"] if self.head else [])
        )
        return "+".join(parts)


def stage_count(
    pp: int, sched: Schedule, n_layers: int, layers_per_stage: int, split_points: list[str]
) -> int:
    """How many stages the model is cut into."""
    if split_points:
        return len(split_points) + 1
    if layers_per_stage:
        return math.ceil((n_layers + 2) / layers_per_stage)
    return pp * (sched.stages_per_rank or 2)


def split_stages(
    n_layers: int,
    n_stages: int,
    layers_per_stage: int = 0,
    split_points: list[str] | None = None,
    weights: list[float] | None = None,
) -> list[StageSpec]:
    """Cut the units [embedding, layer 0 .. n-1, head] into `n_stages` contiguous stages:
    before each `layers.N` of `split_points`; every `layers_per_stage` units; or balanced by
    `weights`, one per unit (the work of each: `balanced_cuts`; None: every unit weighs 1)."""
    units = n_layers + 2
    if split_points:
        cuts = [1 + layer_of(p, n_layers) for p in split_points]
    elif layers_per_stage:
        cuts = [layers_per_stage * (i + 1) for i in range(n_stages - 1)]
    else:
        if weights is not None and len(weights) != units:
            raise ValueError(f"{len(weights)} unit weights for {units} units")
        cuts = list(balanced_cuts(tuple(weights or [1.0] * units), n_stages))
    bounds = [0, *cuts, units]
    specs = []
    for i in range(n_stages):
        lo, hi = bounds[i], bounds[i + 1]
        layers = tuple(u - 1 for u in range(lo, hi) if 1 <= u <= n_layers)
        specs.append(StageSpec(i, lo == 0, layers, hi == units))
    return specs


@functools.lru_cache(maxsize=64)
def balanced_cuts(weights: tuple[float, ...], n_stages: int) -> tuple[int, ...]:
    """Where the stages start (units 1 .. n-1), `n_stages` non-empty contiguous runs of units:
    first the least heaviest stage any cut gives (the pipeline runs at its slowest stage's
    pace), found exactly among the runs' sums; then, from the last stage back, each stage
    takes the units whose work comes closest to an even share of what is left (on a tie the
    more units: the earlier stages, which hold more microbatches in flight under 1F1B and the
    embedding, stay lighter), as long as the units before it still fit under that bound."""
    n = len(weights)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} stages for {n} units")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    sums = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(sums) - 1  # the least feasible bound: a binary search over the sums
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _stages_needed(weights, n, sums[mid]) <= n_stages else (mid + 1, hi)
    bound = sums[lo] * (1 + 1e-9) + 1e-12
    cuts, end = [], n
    for left in range(n_stages - 1, 0, -1):  # this stage is units [start, end); `left` before
        share = prefix[end] / (left + 1)
        fits = [
            s
            for s in range(left, end)
            if prefix[end] - prefix[s] <= bound and _stages_needed(weights, s, bound) <= left
        ]
        start = min(fits, key=lambda s: (abs(prefix[end] - prefix[s] - share), s))
        cuts.append(start)
        end = start
    return tuple(reversed(cuts))


def _stages_needed(weights, n: int, bound: float) -> int:
    """How few stages hold units [0, n) with none heavier than `bound` (inf if one unit is)."""
    count, run = 1, 0.0
    for w in weights[n - 1 :: -1] if n else ():
        if w > bound:
            return 10**9
        if run + w > bound:
            count, run = count + 1, w
        else:
            run += w
    return count


def stage_work(specs: list[StageSpec], weights: list[float]) -> list[float]:
    """Each stage's share of `weights` (one per unit, as `split_stages` takes them)."""
    return [
        (weights[0] if s.embedding else 0.0)
        + sum(weights[1 + i] for i in s.layers)
        + (weights[-1] if s.head else 0.0)
        for s in specs
    ]


def describe_split(specs: list[StageSpec], weights: list[float] | None, how: str) -> str:
    """One line on how the stages were cut and, with `weights`, the heaviest stage's work
    against an even share (the head's weight in layers of the model's heaviest layer)."""
    if weights is None:
        return f"split {how}"
    work = stage_work(specs, weights)
    layer = max(weights[1:-1], default=1.0) or 1.0
    even = sum(work) / len(work)
    return (
        f"split {how}: the head weighs {weights[-1] / layer:.2f} layers, the embedding "
        f"{weights[0] / layer:.2f}; the heaviest stage {max(work) / even:.3f}x an even "
        "share of the work"
    )


def layer_of(point: str, n_layers: int) -> int:
    """`layers.N` -> N, or a ConfigError naming the valid points."""
    name = point.strip()
    index = name[len("layers.") :] if name.startswith("layers.") else ""
    if not index.isdigit() or not 0 <= int(index) < n_layers:
        raise ConfigError(
            f"{SPLIT_KEY} has {point!r}, which names no layer: a split point is "
            f"'layers.N' with N from 0 to {n_layers - 1} (the stage starts at that "
            "layer)"
        )
    return int(index)


def stage_rank(stage: int, pp: int, style: str) -> int:
    """The pp rank that holds `stage`."""
    if style == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def rank_stages(rank: int, pp: int, n_stages: int, style: str) -> list[int]:
    """The stages pp rank `rank` holds, in order."""
    return [s for s in range(n_stages) if stage_rank(s, pp, style) == rank]


def bubble_fraction(sched: Schedule, pp: int, n_microbatches: int, stages_per_rank: int) -> float:
    """The idle fraction of a rank's step in the ideal model of the papers: equal stages, free
    p2p, and a stage's forward (F), input-gradient (B) and weight-gradient (W) passes of equal
    time. Each rank is busy 3 m (m microbatches, F + B + W over its v virtual stages, each 1/v
    of its layers) and idle for the warm-up and cool-down: (pp - 1)(F + B + W) for GPipe and
    1F1B, the same / v interleaved, (pp - 1)(F + B - W) / v for interleaved zero bubble (ZB-H1)
    and (pp - 1)(F + B - 2 W) / v = 0 for ZB-V and DualPipe-V (Qi et al. 2024; DeepSeek-V3).
    Real W passes are shorter than B, so the zero-bubble schedules keep some bubble."""
    m, v = n_microbatches, stages_per_rank
    idle = {
        "GPipe": 3,
        "1F1B": 3,
        "Interleaved1F1B": 3 / v,
        "LoopedBFS": 3 / v,
        "InterleavedZeroBubble": 1 / v,
    }.get(sched.name, 0.0) * (pp - 1)
    return idle / (3 * m + idle)


def check_pipeline(
    par, training, n_layers: int, tied: bool, flavor: str, weights: list[float] | None = None
) -> list[StageSpec]:
    """Every pipeline setting against the model and the batch (`par`: the parallelism section,
    `training` the training section); returns the stages, the default split balanced by
    `weights` (trainer/models/flops.py `unit_flops`; the checks do not depend on them).
    ConfigErrors name the key."""
    pp = par.pipeline_parallel_degree
    sched = schedule(par.pipeline_parallel_schedule)
    if tied:
        raise ConfigError(
            f"{PP_KEY} = {pp} cannot split model.flavor {flavor!r}: its output "
            "head is tied to the token embedding, which would sit on the first "
            "and the last stage; choose a flavor without tie_word_embeddings"
        )
    reshard = par.fsdp_reshard_after_forward
    if sched.split_backward and reshard not in ("default", "never"):
        raise ConfigError(
            f"{SCHEDULE_KEY} = {sched.name!r} computes weight gradients in a "
            "later pass that needs the forward's unsharded parameters: "
            f"parallelism.fsdp_reshard_after_forward = {reshard!r} cannot be used "
            "with it; use 'default' (under pp: never) or 'never', or a schedule "
            "without zero bubble (1F1B, Interleaved1F1B)"
        )
    if par.pipeline_parallel_layers_per_stage and par.pipeline_parallel_split_points:
        raise ConfigError(f"{LAYERS_KEY} and {SPLIT_KEY} both cut the model; set one of them")
    n_stages = stage_count(
        pp,
        sched,
        n_layers,
        par.pipeline_parallel_layers_per_stage,
        par.pipeline_parallel_split_points,
    )
    units = n_layers + 2
    per_rank = n_stages // pp
    if n_stages % pp or per_rank < 1:
        raise ConfigError(
            f"{PP_KEY} = {pp} with {n_stages} stages: the stages must divide "
            f"evenly over the pp ranks (a multiple of {pp})"
        )
    if sched.stages_per_rank is not None and per_rank != sched.stages_per_rank:
        want = sched.stages_per_rank * pp
        raise ConfigError(
            f"{SCHEDULE_KEY} = {sched.name!r} runs {sched.stages_per_rank} "
            f"stage(s) per rank ({want} stages at pp {pp}), but the split gives "
            f"{n_stages}; change {LAYERS_KEY} / {SPLIT_KEY}, or choose "
            + (
                "an interleaved schedule"
                if sched.stages_per_rank == 1 and per_rank > 1
                else "another schedule"
            )
        )
    if sched.stages_per_rank is None and per_rank < 2:
        raise ConfigError(
            f"{SCHEDULE_KEY} = {sched.name!r} needs 2 or more stages per rank, "
            f"but the split gives {n_stages} stages over pp {pp}; use 1F1B or "
            f"GPipe for one stage per rank"
        )
    if n_stages > units:
        raise ConfigError(
            f"{PP_KEY} = {pp} with {sched.name} needs {n_stages} stages, but "
            f"model.flavor {flavor!r} has only {units} units to place ({n_layers} "
            "layers, the embedding and the head); lower the pp degree or choose "
            "a schedule with fewer stages per rank"
        )
    specs = split_stages(
        n_layers,
        n_stages,
        par.pipeline_parallel_layers_per_stage,
        par.pipeline_parallel_split_points,
        weights,
    )
    points = par.pipeline_parallel_split_points
    if points and [layer_of(p, n_layers) for p in points] != sorted(
        {layer_of(p, n_layers) for p in points}
    ):
        raise ConfigError(f"{SPLIT_KEY} = {points} must name distinct layers in increasing order")
    empty = [s.index for s in specs if not (s.embedding or s.layers or s.head)]
    if empty:
        raise ConfigError(
            f"{LAYERS_KEY} = {par.pipeline_parallel_layers_per_stage} leaves "
            f"stage {empty[0]} empty ({n_stages} stages for {units} units)"
        )
    check_microbatches(par, training, sched, n_stages, pp)
    return specs


def check_microbatches(par, training, sched: Schedule, n_stages: int, pp: int) -> int:
    """The schedule's microbatch count: local_batch_size / the pp microbatch size."""
    mbs, local = par.pipeline_parallel_microbatch_size, training.local_batch_size
    if mbs < 1 or local % mbs:
        raise ConfigError(
            f"{MICROBATCH_KEY} = {mbs} must divide training.local_batch_size = "
            f"{local} (each rank's batch is cut into pipeline microbatches)"
        )
    m = local // mbs
    need = {"none": 1, "pp": pp, "stages": n_stages}[sched.min_microbatches]
    if sched.stages_per_rank is None:
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(
                f"{SCHEDULE_KEY} = {sched.name!r} runs microbatches in rounds of "
                f"pp = {pp}: {m} microbatches (training.local_batch_size {local} / "
                f"{MICROBATCH_KEY} {mbs}) must be a multiple of {rounds}"
            )
    if m < need:
        raise ConfigError(
            f"{SCHEDULE_KEY} = {sched.name!r} with {n_stages} stages needs at "
            f"least {need} microbatches per step, but training.local_batch_size "
            f"{local} / {MICROBATCH_KEY} {mbs} gives {m}; raise the batch or lower "
            "the microbatch size"
        )
    return m
