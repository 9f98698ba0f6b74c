"""Under torchrun: one optimizer step of the real trainer pieces, instrumented, per case.

For each case (a name and its config overrides, cases separated by `--`), in one process group:
records every reduce-scatter / all-reduce FSDP issues (name, dtype) per microbatch, whether the
sharded grads exist after each microbatch, the dtype of the unsharded params inside forward,
and writes the full parameters and gradients (rank 0) to OUT_DIR/NAME for comparison.

    torchrun ... accum_probe.py OUT_DIR NAME [--section.key value ...] [-- NAME ...]
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import run_probe_cases
from trainer.config.job import load_config
from trainer.data import build_dataloader
from trainer.device import resolve_compute_dtype
from trainer.models.build import build_model
from trainer.models.flavors import model_args
from trainer.optim.optimizer import build_optimizer
from trainer.parallel.parallelize import parallelize, set_gradient_sync

CALLS: list[tuple[str, str]] = []


def record_collectives() -> None:
    """Wrap torch.distributed's reduce-scatter / all-reduce functions to log (name, dtype)."""
    for name in [n for n in dir(dist) if n.startswith(("reduce_scatter", "all_reduce"))]:
        orig = getattr(dist, name)

        def wrapper(*a, __orig=orig, __name=name, **k):
            t = next((x for x in list(a) + list(k.values()) if isinstance(x, torch.Tensor)), None)
            CALLS.append((__name, str(t.dtype) if t is not None else "?"))
            return __orig(*a, **k)

        setattr(dist, name, wrapper)


def probe(out_dir: str, argv: list[str]) -> None:
    cfg = load_config(argv)
    pd, accum = cfg.resolve(int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(cfg.job.seed)
    pd.build_mesh("cpu")
    dp = pd.dp_mesh
    gbs = cfg.training.local_batch_size * pd.dp_size * accum
    loader = build_dataloader(
        cfg.data,
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        global_batch_size=gbs,
        dp_rank=dp.get_local_rank(),
        dp_size=dp.size(),
        seed=cfg.job.seed,
    )
    args = model_args(cfg.model.flavor, vocab_size=8192, max_seq_len=cfg.training.seq_len)
    precision = resolve_compute_dtype(
        cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce, torch.device("cpu")
    )
    model = parallelize(
        build_model(args), pd, cfg, device=torch.device("cpu"), param_dtype=precision.param
    )
    opt = build_optimizer(model, cfg.optimizer)

    forward_dtypes = set()
    model.layers["0"].attention.wq.register_forward_pre_hook(
        lambda m, _: forward_dtypes.add(str(m.weight.dtype))
    )
    per_micro, grads_present = [], []
    total_tokens = gbs * cfg.training.seq_len
    for i in range(accum):
        inputs, labels = loader.next_microbatch()
        set_gradient_sync(model, cfg.training.gradient_accumulation_sync, is_last=i == accum - 1)
        n0 = len(CALLS)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        (loss * pd.dp_size / total_tokens).backward()
        per_micro.append(CALLS[n0:])
        grads_present.append(all(p.grad is not None for p in model.parameters()))
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()

    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    if dist.get_rank() == 0:
        os.makedirs(out_dir)
        torch.save(full, os.path.join(out_dir, "params.pt"))
        torch.save(grads, os.path.join(out_dir, "grads.pt"))
        with open(os.path.join(out_dir, "probe.json"), "w") as fh:
            json.dump(
                {
                    "per_micro": per_micro,
                    "grads_present": grads_present,
                    "forward_dtypes": sorted(forward_dtypes),
                    "grad_dtypes": grad_dtypes,
                    "accum": accum,
                },
                fh,
            )
    dist.barrier()


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    record_collectives()
    run_probe_cases(argv, probe)
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort it (trainer/train.py)
