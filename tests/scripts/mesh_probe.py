"""Under torchrun: build the mesh for each [PPx]REPLICATExSHARDxCPxTP layout given and write what
each rank sees as JSON (OUT/REPLICATExSHARDxCPxTP/rank<r>.json); one process group, one mesh per
layout."""

import json
import os
import sys

import torch.distributed as dist

from trainer.parallel.dims import ParallelDims


def main(argv: list[str]) -> None:
    out, layouts = argv[0], argv[1:]
    dist.init_process_group("gloo")
    for layout in layouts:
        parts = list(map(int, layout.split("x")))
        pp = parts.pop(0) if len(parts) == 5 else 1
        replicate, shard, cp, tp = parts
        pd = ParallelDims(replicate, shard, dist.get_world_size(), tp=tp, cp=cp, pp=pp)
        mesh = pd.build_mesh("cpu")
        info = {
            "rank": dist.get_rank(),
            "dim_names": list(mesh.mesh_dim_names),
            "shape": list(mesh.shape),
            "dp_size": pd.dp_mesh.size(),
            "dp_rank": pd.dp_mesh.get_local_rank(),
            "replicate_group": dist.get_process_group_ranks(mesh["dp_replicate"].get_group()),
            "shard_group": dist.get_process_group_ranks(mesh["dp_shard"].get_group()),
            "tp_group": dist.get_process_group_ranks(pd.tp_mesh.get_group()),
            "cp_group": dist.get_process_group_ranks(pd.cp_mesh.get_group()),
            # the ranks FSDP shards over (the fsdp mesh's last dimension)
            "fsdp_shard_group": dist.get_process_group_ranks(
                pd.fsdp_mesh.get_group(pd.fsdp_mesh.ndim - 1)
            ),
            "dp_group": dist.get_process_group_ranks(pd.dp_mesh.get_group()),
            "pp_group": dist.get_process_group_ranks(pd.pp_mesh.get_group()),
            "fsdp_mesh_ndim": pd.fsdp_mesh.ndim,
        }
        os.makedirs(os.path.join(out, layout), exist_ok=True)
        with open(os.path.join(out, layout, f"rank{dist.get_rank()}.json"), "w") as fh:
            json.dump(info, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)
