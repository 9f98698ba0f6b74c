"""Communication lanes: which process group a collective of one logical group goes out on.

A pipeline schedule that overlaps one microbatch's forward with another's backward
(DualPipeV's OVERLAP_F_B, trainer/parallel/pipeline.py) runs them on two threads. Collectives on
one process group must be issued in the same order on every rank; two threads issuing on the
same group would interleave differently per rank. So each thread has a lane, and a collective
of logical group `g` issued from the backward lane goes out on `g`'s twin group, created
collectively at setup. Outside an overlapped region (every other schedule, the microbatch
loop) `lane_group(g)` is `g` itself.

    from trainer.parallel.lanes import lane_group
    dist.all_to_all_single(out, inp, group=lane_group(self.group))   # forward and backward
"""

from __future__ import annotations

import threading

_LOCAL = threading.local()
_TWINS: dict = {}  # logical group -> its backward-lane twin (registered at setup)


def lane_group(group):
    """The process group this thread's lane uses for the logical `group`."""
    if getattr(_LOCAL, "lane", "forward") == "backward":
        return _TWINS.get(group, group)
    return group
