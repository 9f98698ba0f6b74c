"""Saving and loading the optimizer's settings as one DCP entry per parameter (the trainer's
`param_groups.<fqn>`, trainer/checkpoint/optim_state.py) against one entry per parameter and
setting (DCP's flattened form: `param_groups.<fqn>.lr`, `.betas`, ... 12 for AdamW).

    torchrun --nproc_per_node 4 benchmarks/checkpoint/bench_checkpoint_entries.py [--flavor F] \
        [--repeats 5]

One launch: the flavor (default debugmodel-moe-narrow, the layout tests' MoE model) under FSDP
over every rank with the trainer's AdamW after one step, then `repeats` rounds of a save and a
load in each form, alternating. Prints rank 0's CPU seconds (its own process: the planning,
pickling and writing a save costs every rank) and wall milliseconds per save and per load,
the median of the rounds, and the DCP entries of each form.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from trainer.checkpoint.optim_state import ModelAndOptimizer
from trainer.config.job import load_config
from trainer.models.build import new_model
from trainer.models.flavors import model_args
from trainer.optim.optimizer import build_optimizer


def trained(flavor: str):
    """The flavor under FSDP over the world, AdamW's state made by one step."""
    torch.manual_seed(0)
    model = new_model(model_args(flavor, vocab_size=256, max_seq_len=64))
    model.init_weights(seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, load_config(["--optimizer.implementation", "for-loop"]).optimizer)
    tokens = torch.randint(0, 256, (2, 65))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    return model, opt


def timed(fn) -> tuple[float, float]:
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    dist.barrier()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavor", default="debugmodel-moe-narrow")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model, opt = trained(args.flavor)
    root = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    box = [root]
    dist.broadcast_object_list(box)
    times = {form: {"save": [], "load": []} for form in ("grouped", "per setting")}
    entries = {}
    for i in range(args.repeats):
        for form in times:
            holder = ModelAndOptimizer(model, opt)
            holder.grouped = form == "grouped"
            folder = f"{box[0]}/{form.replace(' ', '_')}-{i}"
            times[form]["save"].append(
                timed(lambda: dcp.save({"model_optim": holder}, checkpoint_id=folder))
            )
            times[form]["load"].append(
                timed(lambda: dcp.load({"model_optim": holder}, checkpoint_id=folder))
            )
            entries[form] = len(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)
    if dist.get_rank() == 0:
        print(
            f"{args.flavor}, FSDP over {dist.get_world_size()} ranks, AdamW; median of "
            f"{args.repeats} (rank 0: CPU s, wall ms)"
        )
        for form, ops in times.items():
            cells = [
                f"{op} {statistics.median(c for c, _ in t):.3f} CPU-s "
                f"{1000 * statistics.median(w for _, w in t):.0f} ms"
                for op, t in ops.items()
            ]
            print(f"  {form:12s} {entries[form]:5d} entries  " + "  ".join(cells))
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
