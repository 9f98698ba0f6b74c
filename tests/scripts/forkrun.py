"""torchrun for the probe scripts, with the ranks forked from a launcher that has imported torch
and the trainer once, as `trainer.launch` starts CPU training ranks (each rank skips ~4 s of
imports). The script defines `main(argv)`; every rank runs it, under the same elastic agent,
c10d rendezvous and environment (RANK, WORLD_SIZE, ...) as under torchrun.

    python tests/scripts/forkrun.py NPROC SCRIPT [ARGS ...]
    python tests/scripts/forkrun.py --nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID NPROC ...
        (one "node" of N: start one such launcher per node; they meet at the endpoint)
"""

import gc
import os
import runpy
import sys
import time
import traceback

gc.disable()  # while torch and the trainer import, as trainer.launch (enabled before the fork)

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several local ranks
os.environ["CUDA_VISIBLE_DEVICES"] = (
    ""  # CPU ranks: no CUDA before the fork (trainer.launch.hide_gpus)
)

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  (DTensor imports it at its first use)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: E402

import trainer.train  # noqa: E402,F401  (every trainer module a probe may use)
from trainer.launch import FAILED_RANK_GRACE_S  # noqa: E402

gc.freeze()  # the ranks' collections leave the imported heap alone (trainer.launch.main)
gc.enable()


def rank(script: str, argv: list[str]) -> None:
    # the rank's threads, as torch read OMP_NUM_THREADS at its start (this launcher may be a
    # fork of the tests' zygote, whose torch started before the variable was set above)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        runpy.run_path(script, run_name="forked_probe")["main"](argv)
    except Exception:  # its traceback, then wait as trainer.launch.forked_rank does: its
        traceback.print_exc()  # peers fail on the lost connection a moment later
        sys.stderr.flush()
        time.sleep(FAILED_RANK_GRACE_S)
        raise


def options(args: list[str]) -> dict:
    """The leading --nnodes / --rdzv-endpoint / --rdzv-id VALUE pairs of `args` (removed)."""
    found = {"--nnodes": "1", "--rdzv-endpoint": "localhost:0", "--rdzv-id": "probe"}
    while args and args[0] in found:
        key = args.pop(0)
        found[key] = args.pop(0)
    return found


if __name__ == "__main__":
    args = sys.argv[1:]
    opts = options(args)
    nproc, script, argv = int(args[0]), args[1], args[2:]
    nodes = int(opts["--nnodes"])
    config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        run_id=opts["--rdzv-id"],
        rdzv_backend="c10d",
        rdzv_endpoint=opts["--rdzv-endpoint"],
        max_restarts=0,
        monitor_interval=0.1,
        start_method="fork",
    )
    elastic_launch(config, rank)(script, argv)
