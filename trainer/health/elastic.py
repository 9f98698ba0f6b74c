"""Elastic jobs (`python -m trainer.launch --nnodes MIN:MAX`): a lost node shrinks the job,
a node that joins grows it back (docs/multinode.md, "A lost node"). Two changes to torchrun,
installed by trainer/launch.py: every rendezvous round publishes the workers' store anew,
and the ranks learn the round and the largest world the job may have. (And a cheaper name
for the rendezvous's event records: _name_records_cheaply.)"""

from __future__ import annotations

import os
import sys

ROUND_ENV = "TRAINER_RDZV_ROUND"


def rendezvous_anew_each_round() -> None:
    """Let an elastic job grow back. torchrun's c10d rendezvous (torch 2.4-2.13) publishes the
    workers' store address (MASTER_ADDR/PORT under the round's keys) only in a node's first
    round, and reuses its own copy after: when a node joins a running job, the surviving
    rank-0 node skips publishing it for the new round, the joining node waits for the key, and
    both time out (DistStoreError on `.../MASTER_ADDR` and `.../role_info/N`, reproduced with
    two nodes on 127.0.0.1). Forgetting the copy before every round makes the round's rank 0
    serve and publish a store, and every node read it. The round's number goes to the ranks
    (TRAINER_RDZV_ROUND): their process group meets under it, the same on every node (each
    node's restart count is its own: a node that joined later has restarted less)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    if getattr(DynamicRendezvousHandler, "_trainer_anew", False):
        return
    original = DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(self):
        if hasattr(self, "_bootstrap_store_info"):
            self._bootstrap_store_info = None
        info = original(self)
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        if state is not None:
            os.environ[ROUND_ENV] = str(state.round)
        return info

    DynamicRendezvousHandler.next_rendezvous = next_rendezvous
    DynamicRendezvousHandler._trainer_anew = True
    _name_records_cheaply()


def _name_records_cheaply() -> None:
    """The rendezvous names the calling method in each of its event records with
    `inspect.stack()`, twice (every frame's source looked up): ~3 of a 2-rank CPU launch's
    7.7 CPU-s, most at its shutdown (py-spy). The same name,
    read from the frame itself."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic

    def get_method_name(depth: int = 2) -> str:
        try:  # inspect.stack()[depth] of the original: frame 0 is this function's own
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    if callable(getattr(dynamic, "get_method_name", None)):
        dynamic.get_method_name = get_method_name


MAX_WORLD_ENV = "TRAINER_MAX_WORLD_SIZE"


def note_elastic_world(args) -> None:
    """An elastic launch (`--nnodes MIN:MAX`) tells its ranks the largest world it may have
    (TRAINER_MAX_WORLD_SIZE): LOG_RANK may name a rank of the full job while a lost node has
    shrunk it (trainer/train.py)."""
    nnodes, nproc = str(args.nnodes), str(args.nproc_per_node)
    if ":" in nnodes and nproc.isdigit():
        os.environ[MAX_WORLD_ENV] = str(int(nnodes.split(":")[1]) * int(nproc))


def rendezvous_failure(err: Exception, args) -> str:
    """One line for a rendezvous that failed (torchrun's `args`): a node that never came (the
    join timeout), or a closed rendezvous; torchrun would print its traceback."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    where = f"--rdzv_endpoint {args.rdzv_endpoint}, --rdzv_id {args.rdzv_id}"
    if isinstance(err, RendezvousTimeoutError):
        return (
            f"error: the rendezvous timed out ({where}): too few nodes for --nnodes "
            f"{args.nnodes} joined within its join_timeout (--rdzv-conf "
            "join_timeout=SECONDS, default 600): start every node with the same endpoint "
            "and id, and check that each can reach the endpoint"
        )
    return f"error: the rendezvous failed ({where}): {type(err).__name__}: {err}"
