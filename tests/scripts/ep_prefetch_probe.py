"""Under torchrun (4 ranks, EP 2 x FSDP 2, debugmodel-moe-narrow): in the forward, each MoE
block's experts are all-gathered before the block's first all-to-all (the dispatch, whose
split sizes the host must read), because the block prefetches them; without the prefetch their
all-gather would start only after that host sync. Prints "ep prefetch probe ok ..."."""

import sys

import torch
import torch.distributed as dist

from trainer.config.job import load_config
from trainer.models.build import build_model
from trainer.models.common.loss import build_loss
from trainer.models.flavors import model_args
from trainer.parallel.parallelize import parallelize

CALLS: list[tuple[str, int]] = []


def _recorded(name: str, orig):
    def wrapped(*args, **kwargs):
        tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        CALLS.append((name, min(t.numel() for t in tensors) if tensors else 0))
        return orig(*args, **kwargs)

    return wrapped


def record() -> None:
    for name in [n for n in dir(dist) if n.startswith(("all_gather", "all_to_all"))]:
        setattr(dist, name, _recorded(name, getattr(dist, name)))


def main(argv):
    dist.init_process_group("gloo")
    cfg = load_config(
        [
            "--model.flavor",
            "debugmodel-moe-narrow",
            "--training.seq_len",
            "64",
            "--parallelism.expert_parallel_degree",
            "2",
            "--training.mixed_precision_param",
            "float32",
        ]
    )
    pd, _ = cfg.resolve(dist.get_world_size())
    pd.build_mesh("cpu")
    model = parallelize(
        build_model(model_args(cfg.model.flavor, vocab_size=256, max_seq_len=64)),
        pd,
        cfg,
        device=torch.device("cpu"),
        param_dtype="float32",
    )
    moe = [i for i, block in model.layers.items() if hasattr(block.feed_forward, "experts")]
    sizes = {
        i: sum(p.to_local().numel() for p in model.layers[i].feed_forward.experts.parameters())
        for i in moe
    }
    record()
    tokens = torch.randint(0, 256, (2, 64))
    model(tokens, labels=tokens, loss_fn=build_loss("chunked", 1024))
    first_a2a = [k for k, (name, _) in enumerate(CALLS) if name.startswith("all_to_all")]
    assert first_a2a, CALLS
    # the first MoE block: its experts' gather (this rank's shard size) before its dispatch
    gathers = [
        k
        for k, (name, n) in enumerate(CALLS)
        if name.startswith("all_gather") and n == sizes[moe[0]]
    ]
    assert gathers and gathers[0] < first_a2a[0], (CALLS, sizes)
    print(
        f"ep prefetch probe ok: experts all-gathered at call {gathers[0]}, the dispatch's "
        f"first all-to-all at {first_a2a[0]}",
        flush=True,
    )
    unpadded_experts(cfg)
    dist.barrier()
    dist.destroy_process_group()


def unpadded_experts(cfg) -> None:
    """6 experts at ep 2: 3 per ep rank over efsdp = 2 would pad dim 0 to 4 rows; FSDP shards
    the experts' width (Shard(1)) instead, and no rank holds a padded row."""
    from torch.distributed.tensor import Shard

    cfg.moe.num_experts = 6
    pd, _ = cfg.resolve(dist.get_world_size())
    pd.build_mesh("cpu")
    model = parallelize(
        build_model(
            model_args(cfg.model.flavor, vocab_size=256, max_seq_len=64, moe_config=cfg.moe)
        ),
        pd,
        cfg,
        device=torch.device("cpu"),
        param_dtype="float32",
    )
    for name in ("w1", "w2", "w3"):
        p = getattr(model.layers["1"].feed_forward.experts, name)
        assert Shard(1) in p.placements and Shard(0) in p.placements, p.placements
        assert p.to_local().numel() * dist.get_world_size() == p.numel(), (name, p.placements)
    print(f"expert shard probe ok: {p.placements}", flush=True)


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
