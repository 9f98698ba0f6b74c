"""Under torchrun (2 ranks, TP 2): Muon's update of each attention and FFN matrix equals the
update one process computes from the same gradient (gathered; it equals the one-process model's
gradient within 1e-4), because Newton-Schulz ran on the whole matrix; orthogonalizing each tp shard
on its own instead gives an update far from it (the check can fail). Prints "muon probe ok ..." when
it passes."""

import dataclasses
import sys

import torch
import torch.distributed as dist

from trainer.config.job import load_config
from trainer.models.build import build_model, new_model
from trainer.models.common.loss import build_loss
from trainer.models.flavors import model_args
from trainer.optim.muon import orthogonalize
from trainer.optim.optimizer import build_optimizer
from trainer.parallel.parallelize import parallelize

VOCAB, SEQ = 256, 32
MATRICES = (
    "attention.wq.weight",
    "attention.wo.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
)


def models(overrides: list[str]):
    """(config, the trainer's parallelized 2-layer debug model at dim 64, the same weights
    unsplit)."""
    cfg = load_config(overrides)
    pd, _ = cfg.resolve(dist.get_world_size())
    pd.build_mesh("cpu")
    narrow = model_args("debugmodel-narrow", vocab_size=VOCAB, max_seq_len=SEQ)
    args = dataclasses.replace(narrow, n_layers=2)
    model = parallelize(
        build_model(args), pd, cfg, device=torch.device("cpu"), param_dtype="float32"
    )
    ref = new_model(args)
    ref.init_weights(cfg.job.seed)
    return cfg, pd, model, ref


def one_rank() -> None:
    """The trainer's model (FSDP over one rank: DTensor parameters) with its Muon, 10 steps,
    against a plain model with torch.optim.Muon (the matrices) and torch.optim.AdamW (the
    rest) on the same batches: fp32 weights, Newton-Schulz in bf16 (torch's), within 1e-6."""
    from trainer.optim.muon import takes_muon

    cfg, _, model, ref = models(
        ["--optimizer.name", "Muon", "--optimizer.implementation", "for-loop"]
    )
    o = cfg.optimizer
    opt = build_optimizer(model, o)
    names = dict(ref.named_parameters())
    refs = [
        torch.optim.Muon(
            [p for n, p in names.items() if takes_muon(n, p)],
            lr=o.lr,
            weight_decay=o.weight_decay,
            momentum=o.muon_momentum,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        ),
        torch.optim.AdamW(
            [p for n, p in names.items() if not takes_muon(n, p)],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            foreach=False,
        ),
    ]
    gen = torch.Generator().manual_seed(0)
    loss_fn = build_loss("chunked", 24)
    worst = 0.0
    for _ in range(10):
        inputs, labels = (torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2))
        losses = []
        for m, opts in ((model, [opt]), (ref, refs)):
            loss = m(inputs, labels=labels, loss_fn=loss_fn) / labels.numel()
            loss.backward()
            for x in opts:
                x.step()
                x.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.full_tensor() - q).abs().max().item() <= 1e-6, name
    assert worst <= 1e-6, worst
    print(
        f"muon probe ok: one rank = torch.optim.Muon + AdamW over 10 steps (loss diff {worst:.1e})",
        flush=True,
    )


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    if dist.get_world_size() == 1:
        one_rank()
        dist.destroy_process_group()
        return
    cfg, pd, model, ref = models(
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--optimizer.name",
            "Muon",
            "--optimizer.muon_ns_dtype",
            "float32",
            "--optimizer.muon_lr_adjust",
            "none",
            "--optimizer.weight_decay",
            "0",
            "--optimizer.lr",
            "1.0",
        ]
    )
    gen = torch.Generator().manual_seed(0)
    inputs, labels = (torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2))
    loss_fn = build_loss("chunked", 24, vocab_parallel_group=pd.loss_parallel_group)
    model(inputs, labels=labels, loss_fn=loss_fn).backward()
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    build_optimizer(model, cfg.optimizer).step()
    ref(inputs, labels=labels, loss_fn=build_loss("chunked", 24)).backward()
    m = cfg.optimizer.muon_momentum
    ref_grads = dict(ref.named_parameters())
    worst_whole, best_shard = 0.0, float("inf")
    for name, p in model.named_parameters():
        if not name.endswith(MATRICES):
            continue
        update = before[name] - p.full_tensor()  # lr 1, no decay, no lr scaling: the NS output
        g = grads[name]  # the TP run's gradient, gathered: Newton-Schulz's input
        assert torch.allclose(g, ref_grads[name].grad, rtol=1e-4, atol=1e-6), name
        nesterov = g.lerp(g * (1 - m), m)  # step 1: the buffer is (1 - m) g
        whole = orthogonalize(nesterov, 5, torch.float32)
        dim = p.placements[-1].dim  # the tp shard's dim: 0 column-wise, 1 row-wise
        shards = torch.cat(
            [orthogonalize(s, 5, torch.float32) for s in nesterov.chunk(2, dim=dim)], dim=dim
        )
        scale = whole.abs().max()
        worst_whole = max(worst_whole, ((update - whole).abs().max() / scale).item())
        best_shard = min(best_shard, ((update - shards).abs().max() / scale).item())
    assert worst_whole < 1e-5, worst_whole
    assert best_shard > 1e-2, best_shard
    print(
        f"muon probe ok: whole-matrix error {worst_whole:.1e}, per-shard {best_shard:.1e}",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun; tests/scripts/forkrun.py calls main() instead
    main(sys.argv[1:])
