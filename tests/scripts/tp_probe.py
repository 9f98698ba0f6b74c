"""Under torchrun (2 ranks, TP 2): the loss-parallel head against the gathered one and a
single-process reference, with a tracker of every tensor the loss creates.

The seeded init gives the reference's weights bitwise. For the untied and the tied debug model (2
layers, fp32), each loss kind (chunked, eager) with and without a z-loss, and labels with ignored
tokens: the TP model's loss equals the reference's (the same weights on one process) within 1e-5,
and every gradient, gathered, within 1e-5 of its largest element; so do the logits without labels
(gathered over tp) and the eval scores of odd-length requests. A TorchDispatchMode records the shape
of every tensor an op returns during forward and backward: under loss parallel no tensor has a
dimension of the full vocabulary; the gathered variant (disable_loss_parallel) does (the tracker
sees the full logits chunk), so the tracker can fail. One case compiles the blocks (torch.compile on
CPU). Prints "tp probe ok ..." per passing case.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.config.job import load_config
from trainer.evals.scoring import Request, score_batch
from trainer.models.build import build_model, new_model
from trainer.models.common.loss import IGNORE_INDEX, build_loss, scoring_loss
from trainer.models.flavors import model_args
from trainer.parallel.parallelize import parallelize

VOCAB, SEQ = 1024, 32


class ShapeTracker(TorchDispatchMode):
    """The shape of every tensor with memory of its own an op returns: a DTensor's shape is
    global, so the mode records the local tensors its ops dispatch to instead."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):  # owns memory
                self.shapes.add(tuple(t.shape))
        return out


def run(flavor: str, kind: str, z: float, loss_parallel: bool, compile: bool = False) -> None:
    overrides = [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--training.seq_len",
        str(SEQ),
        "--compile.enable",
        str(compile).lower(),
    ]
    if not loss_parallel:
        overrides += ["--parallelism.disable_loss_parallel", "true"]
    cfg = load_config(overrides)
    pd, _ = cfg.resolve(dist.get_world_size())
    pd.build_mesh("cpu")
    args = dataclasses.replace(model_args(flavor, vocab_size=VOCAB, max_seq_len=SEQ), n_layers=2)
    model = parallelize(
        build_model(args), pd, cfg, device=torch.device("cpu"), param_dtype="float32"
    )
    ref = new_model(args)
    ref.init_weights(cfg.job.seed)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q), name  # the seeded init ignores the layout
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels[0, :5] = IGNORE_INDEX
    loss_fn = build_loss(kind, 24, z_loss_weight=z, vocab_parallel_group=pd.loss_parallel_group)
    tracker = ShapeTracker()
    with tracker:
        loss = model(inputs, labels=labels, loss_fn=loss_fn)
        (loss * 0.01).backward()
    ref_loss = ref(inputs, labels=labels, loss_fn=build_loss(kind, 24, z_loss_weight=z))
    (ref_loss * 0.01).backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), (loss, ref_loss)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        got = p.grad.full_tensor()
        assert (got - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), (name, flavor, kind)
    with torch.no_grad():  # logits without labels (evals, validation): gathered over tp
        logits, ref_logits = model(inputs), ref(inputs)
    assert logits.shape == (2, SEQ, VOCAB) and torch.allclose(logits, ref_logits, atol=1e-5)
    requests = [Request(tuple(range(3, 3 + n)), 2) for n in (8, 11)]  # widths 7 and 10
    got = score_batch(model, requests, "cpu", scoring_loss(24, pd.loss_parallel_group))
    want = score_batch(ref, requests, "cpu", scoring_loss(24))
    assert torch.allclose(got, want, atol=1e-4), (got, want)  # evals: padded to even shards
    full_vocab = sorted(s for s in tracker.shapes if VOCAB in s)
    case = f"{flavor} {kind} z={z} loss_parallel={loss_parallel} compile={compile}"
    if loss_parallel:
        assert not full_vocab, f"{case}: full-vocabulary tensors {full_vocab}"
        assert any(VOCAB // 2 in s for s in tracker.shapes), tracker.shapes  # the shard's
    else:
        assert full_vocab, f"{case}: the tracker saw no full-vocabulary tensor"
    print(f"tp probe ok {case} largest-vocab-dim-shapes {full_vocab[:3]}", flush=True)


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    for flavor in ("debugmodel", "debugmodel-3.2"):
        for kind, z in (("chunked", 0.0), ("chunked", 1e-3), ("eager", 1e-3)):
            run(flavor, kind, z, loss_parallel=True)
        run(flavor, "chunked", 1e-3, loss_parallel=False)
    # compiled blocks (a compiled first block once dropped FSDP's hook on the embedding's
    # output view: its gradient was wrong)
    run("debugmodel", "chunked", 0.0, loss_parallel=True, compile=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
