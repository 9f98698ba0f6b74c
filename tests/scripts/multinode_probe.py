"""Under a multi-node launch: build the trainer's HSDP mesh and write, per rank, which node
(launcher process) it runs on and which ranks share its replicate and shard groups, plus the
result of one all-reduce over each group (proof that the groups really communicate).

    python -m trainer.launch --nnodes 2 ... tests/scripts/multinode_probe.py REPLICATE OUT_DIR
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from trainer.parallel.dims import ParallelDims

replicate, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
pd = ParallelDims(replicate, -1, dist.get_world_size())
mesh = pd.build_mesh("cpu")


def members_and_sum(dim: str):
    group = mesh[dim].get_group()
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=group)
    return dist.get_process_group_ranks(group), value.item()


replicate_group, replicate_sum = members_and_sum("dp_replicate")
shard_group, shard_sum = members_and_sum("dp_shard")
info = {
    "rank": rank,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "node_rank": int(os.environ["GROUP_RANK"]),
    "launcher_pid": os.getppid(),  # the torchrun agent that started this worker: its "node"
    "replicate_group": replicate_group,
    "replicate_sum": replicate_sum,
    "shard_group": shard_group,
    "shard_sum": shard_sum,
    "dp_rank": pd.dp_mesh.get_local_rank(),
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(info, fh)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
