"""Under torchrun (4 ranks, PP 2 x FSDP 2): one step of 4 accumulation microbatches through the
real PipelineLoop, counting FSDP's reduce-scatters and all-gathers. With
gradient_accumulation_sync 'last' each FSDP group of the rank's stage reduces once per
optimizer step; with 'every', once per microbatch; the gradients agree. Each group is gathered
once per schedule step (reshard 'never' under PP): FSDP2's implicit backward prefetch reaches
into no other microbatch's head group. Prints "pp accum probe ok ..." when it passes."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from trainer.config.job import load_config
from trainer.models.build import build_model
from trainer.models.common.loss import build_loss
from trainer.models.flavors import model_args
from trainer.parallel.forward_backward import build_forward_backward
from trainer.parallel.fsdp import fsdp_param_groups
from trainer.parallel.parallelize import parallelize

VOCAB, SEQ, ACCUM = 256, 64, 4
CALLS: list[str] = []
GATHERS: list[str] = []


def _counted(name: str, orig, calls: list):
    def counted(*args, **kwargs):
        calls.append(name)
        return orig(*args, **kwargs)

    return counted


def count_collectives() -> None:
    """Wrap torch.distributed's reduce-scatters (FSDP2 calls reduce_scatter_single on torch
    2.13, reduce_scatter_tensor before) and all-gathers (all_gather_single or _into_tensor)."""
    kinds = ("reduce_scatter", "all_gather_into", "all_gather_single")
    for name in [n for n in dir(dist) if n.startswith(kinds)]:
        calls = CALLS if name.startswith("reduce") else GATHERS
        setattr(dist, name, _counted(name, getattr(dist, name), calls))


def step(sync: str):
    cfg = load_config(
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--model.flavor",
            "debugmodel-narrow",
            "--training.seq_len",
            str(SEQ),
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "16",
            "--training.mixed_precision_param",
            "float32",
            "--training.gradient_accumulation_sync",
            sync,
        ]
    )
    pd, accum = cfg.resolve(dist.get_world_size())
    assert accum == ACCUM, accum
    pd.build_mesh("cpu")
    model = parallelize(
        build_model(model_args(cfg.model.flavor, vocab_size=VOCAB, max_seq_len=SEQ)),
        pd,
        cfg,
        device=torch.device("cpu"),
        param_dtype="float32",
    )
    groups = len(
        {
            id(group)  # [norm, head] share one
            for stage in model.pipeline_stages
            for m in stage.modules()
            if isinstance(m, FSDPModule)
            for group in fsdp_param_groups(fully_shard.state(m))
        }
    )
    fb = build_forward_backward(
        model, build_loss("chunked", 1024), cfg, parallel_dims=pd, device=torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(dist.get_rank() // 2)  # one dp rank: the same data
    batches = [
        tuple(torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2))
        for _ in range(ACCUM)
    ]
    CALLS.clear()
    GATHERS.clear()
    fb(batches, torch.tensor(16.0 * SEQ), 1)
    gathers = len(GATHERS)  # before full_tensor() below gathers the gradients
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return len(CALLS), groups, grads, gathers


def main(argv):
    dist.init_process_group("gloo")
    count_collectives()
    once, groups, g_last, gathers = step("last")
    every, _, g_every, _ = step("every")
    assert groups > 0 and once == groups, (once, groups)
    assert every == ACCUM * groups, (every, groups)
    assert gathers == ACCUM * groups, (dist.get_rank(), gathers, groups)  # once a schedule step
    for name, g in g_last.items():
        assert torch.allclose(g, g_every[name], rtol=1e-5, atol=1e-7), name
    print(
        f"pp accum probe ok: {once} reduce-scatters per optimizer step ({groups} FSDP groups, "
        f"{ACCUM} microbatches; {every} with sync 'every'), {gathers} all-gathers",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
