"""Under torchrun: the FSDP2 options on the trainer's own pieces, instrumented.

1. Five training steps with `fsdp_reshard_after_forward = 2` and with `default`, on the same
   batches; the first hpZ step records every all-gather FSDP issues (the number of ranks of
   its group) in forward and in backward.
2. The same model built with `fsdp_offload = "cpu"` (FSDP2's CPUOffloadPolicy, unpinned:
   pinning needs CUDA) next to one without: their model and optimizer state dicts must have
   the same keys, global shapes, placements and meshes; a DCP checkpoint of each (after one
   identical step) loads into the other.

    torchrun ... fsdp_options_probe.py OUT_DIR [--section.key value ...]
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from trainer.checkpoint.checkpointer import ModelAndOptimizer
from trainer.config.job import load_config
from trainer.models.args import ModelArgs
from trainer.models.build import build_model
from trainer.optim.optimizer import build_optimizer
from trainer.parallel.parallelize import parallelize

CPU = torch.device("cpu")

out_dir, argv = sys.argv[1], sys.argv[2:]
dist.init_process_group("gloo")


def build(*extra: str):
    cfg = load_config([*argv, *extra])
    pd, _ = cfg.resolve(dist.get_world_size())
    pd.build_mesh("cpu")
    # A small GQA shape: what is checked is per tensor, not per size.
    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=512,
        multiple_of=32,
        max_seq_len=cfg.training.seq_len,
    )
    model = parallelize(
        build_model(args), pd, cfg, device=CPU, param_dtype=cfg.training.mixed_precision_param
    )
    return cfg, model, build_optimizer(model, cfg.optimizer)


def batch(cfg, seed: int):
    gen = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    return torch.randint(
        0, 512, (cfg.training.local_batch_size, cfg.training.seq_len + 1), generator=gen
    )


def step(model, opt, tokens, phase=None) -> torch.Tensor:
    """One optimizer step on this rank's batch; returns its loss. `phase[0]` is set to
    'forward' and 'backward' while they run (for the collective counter)."""
    phase = phase if phase is not None else [None]
    phase[0] = "forward"
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    phase[0] = "backward"
    loss.backward()
    phase[0] = None
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# --------------------------------------------------------------------------- 1. hpZ
RESHARD = "--parallelism.fsdp_reshard_after_forward"
STEPS = 5
cfg, model, opt = build(RESHARD, "2")
phase: list = [None]
gathers: list[tuple[str, int]] = []
originals = {n: getattr(dist, n) for n in dir(dist) if n.startswith("all_gather")}
for name, orig in originals.items():

    def wrapper(*a, __orig=orig, **k):
        if phase[0] is not None:
            gathers.append((phase[0], dist.get_world_size(k.get("group"))))
        return __orig(*a, **k)

    setattr(dist, name, wrapper)
step_losses = {"2": [step(model, opt, batch(cfg, 0), phase)]}
for name, orig in originals.items():
    setattr(dist, name, orig)
step_losses["2"] += [step(model, opt, batch(cfg, i)) for i in range(1, STEPS)]
cfg, model, opt = build(RESHARD, "default")
step_losses["default"] = [step(model, opt, batch(cfg, i)) for i in range(STEPS)]
loss_diff = (torch.stack(step_losses["2"]) - torch.stack(step_losses["default"])).abs().max()
dist.all_reduce(loss_diff, op=dist.ReduceOp.MAX)  # every rank's losses, not just rank 0's


# --------------------------------------------------------------------------- 2. offload
def flat_state(model, opt) -> dict:
    """Model and optimizer state as DCP sees it, one entry per tensor."""
    sd = ModelAndOptimizer(model, opt).state_dict()
    # the optimizer's part is flat (checkpointer.py): "state.<fqn>.<name>" -> tensor
    return {
        **{f"model.{k}": v for k, v in sd["model"].items()},
        **{
            f"optim.{k[len('state.') :]}": t
            for k, t in sd["optimizer"].items()
            if k.startswith("state.") and isinstance(t, torch.Tensor)
        },
    }


def full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


layouts, values, devices, built = {}, {}, {}, {}
for offload in ("none", "cpu"):
    cfg, model, opt = built[offload] = build("--parallelism.fsdp_offload", offload)
    step(model, opt, batch(cfg, 1))
    values[offload] = {k: full(v) for k, v in flat_state(model, opt).items()}
    layouts[offload] = {
        k: [
            list(v.shape),
            str(getattr(v, "placements", None)),
            str(getattr(v, "device_mesh", None)),
        ]
        for k, v in flat_state(model, opt).items()
    }
    devices[offload] = sorted({str(p.to_local().device) for p in model.parameters()})
# One more step for the offloaded model, so that the two states differ; then each
# checkpoint loads into the other layout.
cfg, model, opt = built["cpu"]
step(model, opt, batch(cfg, 2))
values["cpu 2"] = {k: full(v) for k, v in flat_state(model, opt).items()}
for offload, (_cfg, model, opt) in built.items():
    dcp.save(
        ModelAndOptimizer(model, opt).state_dict(),
        checkpoint_id=os.path.join(out_dir, f"ckpt-{offload}"),
    )
for src, dst in (("none", "cpu"), ("cpu", "none")):
    holder = ModelAndOptimizer(*built[dst][1:])
    state = holder.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(out_dir, f"ckpt-{src}"))
    holder.load_state_dict(state)
    values[f"{src}->{dst}"] = {k: full(v) for k, v in flat_state(*built[dst][1:]).items()}


def equal(a: str, b: str) -> bool:
    return values[a].keys() == values[b].keys() and all(
        torch.equal(values[a][k], values[b][k]) for k in values[a]
    )


if dist.get_rank() == 0:
    with open(os.path.join(out_dir, "probe.json"), "w") as fh:
        json.dump(
            {
                "gathers": gathers,
                "loss_max_abs_diff": loss_diff.item(),
                "losses": {k: [x.item() for x in v] for k, v in step_losses.items()},
                "layouts": layouts,
                "devices": devices,
                "same_after_step": equal("none", "cpu"),
                "states_differ": not equal("none", "cpu 2"),
                "loaded_none_into_cpu": equal("none->cpu", "none"),
                "loaded_cpu_into_none": equal("cpu->none", "cpu 2"),
            },
            fh,
        )
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown: gloo threads can abort it (trainer/train.py)
