"""Communication lanes: which process group a collective of one logical group goes out on.

A pipeline schedule that overlaps one microbatch's forward with another's backward
(DualPipeV's OVERLAP_F_B, trainer/parallel/dualpipe.py) runs them on two threads. Collectives on
one process group must be issued in the same order on every rank; two threads issuing on the
same group would interleave differently per rank. So each thread has a lane, and a collective
of logical group `g` issued from the backward lane goes out on `g`'s twin group, created
collectively at setup (`make_twins`). Outside an overlapped region (every other schedule, the
microbatch loop) `lane_group(g)` is `g` itself.

    from trainer.parallel.lanes import lane_group
    dist.all_to_all_single(out, inp, group=lane_group(self.group))   # forward and backward

A collective issued inside an autograd backward must look its group up when the backward runs
(not capture it at forward time): the backward of microbatch i runs on the backward lane while
its forward ran on the forward lane.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch.distributed as dist

FORWARD, BACKWARD = "forward", "backward"
_LOCAL = threading.local()
_TWINS: dict = {}  # logical group -> its backward-lane twin (registered at setup)


def lane_group(group):
    """The process group this thread's lane uses for the logical `group`."""
    if getattr(_LOCAL, "lane", FORWARD) == BACKWARD:
        return _TWINS.get(group, group)
    return group


def current_lane() -> str:
    """This thread's lane: "forward" (the default, every thread) or "backward"."""
    return getattr(_LOCAL, "lane", FORWARD)


@contextmanager
def lane(name: str):
    """Run the block on lane `name` ("forward" or "backward") in this thread."""
    if name not in (FORWARD, BACKWARD):
        raise ValueError(f"lane {name!r}: the lanes are {FORWARD!r} and {BACKWARD!r}")
    before = current_lane()
    _LOCAL.lane = name
    try:
        yield
    finally:
        _LOCAL.lane = before


def has_twin(group) -> bool:
    """Whether `group` has a backward-lane twin (collectives on it may overlap)."""
    return group in _TWINS


def make_twins(groups) -> int:
    """Create a backward-lane twin for each process group in `groups` (this rank's groups, in
    any number, possibly none): a collective over the default group, so every rank calls it
    once, at the same point. Every rank's groups are gathered by their ranks, and every rank
    creates the union's groups in one sorted order (`new_group` is collective over the world);
    each rank keeps the twins of its own. Returns how many twin groups this rank holds.

    Gathering rather than taking the groups from the model matters: a pp rank whose stages
    hold no MoE layer has no ep dispatcher, yet must join the creation of the others' twins."""
    mine = {}
    for g in groups:
        if g is not None and g not in _TWINS:
            mine.setdefault(tuple(dist.get_process_group_ranks(g)), []).append(g)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered, [(ranks, str(dist.get_backend(gs[0]))) for ranks, gs in mine.items()]
    )
    for ranks, backend in sorted({entry for each in gathered for entry in each}):
        twin = dist.new_group(list(ranks), backend=backend)
        for g in mine.get(ranks, ()):
            _TWINS[g] = twin
    return len({id(_TWINS[g]) for gs in mine.values() for g in gs})
