"""Under torchrun (2 ranks): the chunked loss inside FSDP's head group equals the eager one.

For the untied and the tied model (2 layers, fp32, the head resharded after forward so its
backward re-gathers it), two iterations per loss (the second checks that FSDP's forward and
backward hooks of the head group fired and reset), comparing the loss and every rank's
gradient shards. Prints "loss probe ok <flavor> <iteration>" per passing check.
"""

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from trainer.config.job import load_config
from trainer.models.build import build_model
from trainer.models.common.loss import IGNORE_INDEX, build_loss
from trainer.models.flavors import model_args
from trainer.parallel.parallelize import parallelize


def grads_after(model, loss_fn, inputs, labels):
    model.zero_grad(set_to_none=True)
    loss = model(inputs, labels=labels, loss_fn=loss_fn)
    (loss * 0.01).backward()
    return loss.detach(), [p.grad.to_local().clone() for p in model.parameters()]


def check(flavor: str) -> None:
    cfg = load_config(
        ["--parallelism.fsdp_reshard_after_forward", "always", "--training.seq_len", "32"]
    )
    pd, _ = cfg.resolve(dist.get_world_size())
    pd.build_mesh("cpu")
    args = dataclasses.replace(model_args(flavor, vocab_size=999, max_seq_len=32), n_layers=2)
    model = parallelize(
        build_model(args), pd, cfg, device=torch.device("cpu"), param_dtype="float32"
    )
    gen = torch.Generator().manual_seed(dist.get_rank())
    inputs = torch.randint(0, 999, (2, 32), generator=gen)
    labels = torch.randint(0, 999, (2, 32), generator=gen)
    labels[0, :5] = IGNORE_INDEX
    eager, chunked = build_loss("eager", 0), build_loss("chunked", 24)  # 64 tokens: 24+24+16
    for it in range(2):
        ref_loss, ref = grads_after(model, eager, inputs, labels)
        loss, got = grads_after(model, chunked, inputs, labels)
        assert torch.allclose(loss, ref_loss, rtol=1e-6), (loss, ref_loss)
        for a, b in zip(got, ref, strict=True):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), flavor
        print(f"loss probe ok {flavor} {it}", flush=True)


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    check("debugmodel")
    check("debugmodel-3.2")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort it (trainer/train.py)
