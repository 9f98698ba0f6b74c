"""Under torchrun: build the mesh for (replicate, shard) and write what each rank sees as JSON."""

import json
import os
import sys

import torch.distributed as dist

from trainer.parallel_dims import ParallelDims

replicate, shard, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
pd = ParallelDims(replicate, shard, dist.get_world_size())
mesh = pd.build_mesh("cpu")
info = {
    "rank": dist.get_rank(),
    "dim_names": list(mesh.mesh_dim_names),
    "shape": list(mesh.shape),
    "dp_size": pd.dp_mesh.size(),
    "dp_rank": pd.dp_mesh.get_local_rank(),
    "replicate_group": dist.get_process_group_ranks(mesh["dp_replicate"].get_group()),
    "shard_group": dist.get_process_group_ranks(mesh["dp_shard"].get_group()),
    "fsdp_mesh_ndim": pd.fsdp_mesh.ndim,
}
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump(info, fh)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
