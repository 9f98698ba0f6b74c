"""Under torchrun: two training steps of the real trainer pieces, the second one measured.

Builds the model with the trainer's own `parallelize` and AdamW, runs two steps (forward, the
trainer's loss, backward, clip, optimizer step), the second under torch's `FSDPMemTracker`,
and writes one JSON per rank with:
- `local`: bytes of this rank's shards as tensors see them (`p.to_local()`, `p.grad.to_local()`,
  each optimizer state tensor's local shard);
- `storage`: bytes of the distinct storages behind them (FSDP2 pads uneven shards, so the
  storage of a short last shard is as big as rank 0's);
- `tracker`: the tracker's bytes by category after forward, at the peak up to the end of
  backward, and at the step's peak (optimizer step included).

    torchrun ... plan_probe.py OUT_DIR NAME [--section.key value ...] [-- NAME ...]

Each case (a name and its overrides, cases separated by `--`) runs in the same process group
and writes OUT_DIR/NAME/rank<r>.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from tests.helpers import run_probe_cases
from trainer.config.job import load_config
from trainer.device import resolve_compute_dtype
from trainer.models.build import build_model
from trainer.models.common.loss import build_loss
from trainer.models.flavors import model_args
from trainer.optim.optimizer import build_optimizer
from trainer.parallel.parallelize import parallelize


def local(t) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sizes(tensors) -> dict:
    """Bytes of the local shards, and of the distinct storages behind them."""
    tensors = [local(t) for t in tensors]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return {
        "local": sum(t.numel() * t.element_size() for t in tensors),
        "storage": sum(storages.values()),
    }


def snapshot(tracker, kind: str = "current") -> dict:
    """The tracker's bytes by category on CPU, keyed by category name ("Activation", ...)."""
    snap = tracker.get_tracker_snapshot(kind).get(torch.device("cpu"), {})
    return {getattr(k, "value", str(k)): v for k, v in snap.items()}


def probe(out_dir: str, argv: list[str]) -> None:
    cfg = load_config(argv)
    pd, _ = cfg.resolve(int(os.environ["WORLD_SIZE"]))
    pd.build_mesh("cpu")
    args = model_args(
        cfg.model.flavor, vocab_size=cfg.model.vocab_size or None, max_seq_len=cfg.training.seq_len
    )
    model = parallelize(
        build_model(args),
        pd,
        cfg,
        device=torch.device("cpu"),
        param_dtype=resolve_compute_dtype(
            cfg.training.mixed_precision_param,
            cfg.training.mixed_precision_reduce,
            torch.device("cpu"),
        ).param,
    )
    opt = build_optimizer(model, cfg.optimizer)
    gen = torch.Generator().manual_seed(dist.get_rank())
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    inputs = torch.randint(0, args.vocab_size, shape, generator=gen)
    labels = torch.randint(0, args.vocab_size, shape, generator=gen)

    loss_fn = build_loss(cfg.training.loss, cfg.training.loss_chunk_size)

    def step(tracker=None):
        loss = model(inputs, labels=labels, loss_fn=loss_fn)  # the trainer's loss (train.py)
        after_forward = snapshot(tracker) if tracker else None
        (loss * pd.dp_size / (inputs.numel() * pd.dp_size)).backward()
        del loss
        backward_peak = snapshot(tracker, "peak") if tracker else None
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        return after_forward, backward_peak

    step()  # the optimizer state exists from the first step on: measure the second
    opt.zero_grad(set_to_none=True)
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((inputs, labels))
    with tracker:
        after_forward, backward_peak = step(tracker)
    step_peak = snapshot(tracker, "peak")
    params = list(model.parameters())
    states = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    result = {
        "rank": dist.get_rank(),
        "params": sizes(params),
        "grads": sizes([p.grad for p in params]),
        "optimizer": sizes(states),
        "tracker": {
            "after_forward": after_forward,
            "backward_peak": backward_peak,
            "step_peak": step_peak,
        },
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(result, fh)
    dist.barrier()


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    run_probe_cases(argv, probe)
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort it (trainer/train.py)
