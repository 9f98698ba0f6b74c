"""Under forkrun (2 ranks, CP 2): context-parallel attention against one process, and the leak
test.

The debug model (2 layers, fp32, seq 64: four chunks of 16) is sharded by the trainer's own
`parallelize` over the cp mesh; a one-process copy holds the same seeded weights. A window of
three documents, [0, 10), [10, 40), [40, 64), spreads each over both ranks' chunks (rank 0
keeps 0-15 and 48-63, rank 1 16-47). For `causal` and for `block_causal` with document
positions, the loss of the middle document alone (the other labels ignored):
- equals the one-process loss within 1e-5, and so does the gradient of the input embeddings
  of every token (gathered over cp) and of every parameter;
- block_causal: that gradient is exactly zero at every token of the other two documents, on
  both ranks (fp32), and not zero on the middle one: no token saw another document's tokens
  through the K/V all-gather; causal: zero after the document only.
Prints "cp probe ok <case>" per passing case.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.config.job import load_config
from trainer.models.build import build_model, new_model
from trainer.models.common.attention import document_positions
from trainer.models.common.loss import IGNORE_INDEX, build_loss
from trainer.models.flavors import model_args
from trainer.parallel.context_parallel import ContextAttention, head_tail_index
from trainer.parallel.parallelize import parallelize

SEQ, VOCAB = 64, 1024
DOCS = torch.tensor([0] * 10 + [1] * 30 + [2] * 24)[None]  # [1, 64]


def embeddings_grad(model, forward) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d input embeddings) of `forward(model)`."""
    held = {}

    def keep(module, args, out):
        out.retain_grad()
        held["emb"] = out

    handle = model.tok_embeddings.register_forward_hook(keep)
    loss = forward(model)
    loss.backward()
    handle.remove()
    return loss.detach(), held["emb"].grad.detach()


def run(mask: str) -> None:
    positions = "document" if mask == "block_causal" else "sequence"
    cfg = load_config(
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--training.seq_len",
            str(SEQ),
            "--model.attn_mask_type",
            mask,
            "--model.positions",
            positions,
            "--model.attn_implementation",
            "sdpa" if mask == "block_causal" else "auto",
        ]
    )
    pd, _ = cfg.resolve(dist.get_world_size())
    pd.build_mesh("cpu")
    args = dataclasses.replace(
        model_args(
            "debugmodel",
            vocab_size=VOCAB,
            max_seq_len=SEQ,
            attn_mask_type=mask,
            positions=positions,
            attn_implementation="sdpa",
        ),
        n_layers=2,
    )
    model = parallelize(
        build_model(args), pd, cfg, device=torch.device("cpu"), param_dtype="float32"
    )
    ref = new_model(args)
    ref.init_weights(cfg.job.seed)
    ref.init_rope()
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.where(DOCS == 1, torch.roll(tokens, -1, 1), IGNORE_INDEX)
    loss_fn = build_loss("chunked", 1024)

    want_loss, want_grad = embeddings_grad(ref, lambda m: m(tokens, labels, loss_fn, doc_ids=DOCS))
    rank, cp_group = pd.cp_mesh.get_local_rank(), pd.cp_mesh.get_group()
    index = head_tail_index(SEQ, 2, rank)
    order = torch.cat([head_tail_index(SEQ, 2, r) for r in range(2)])
    pos = document_positions(DOCS)[:, index] if positions == "document" else index
    attention = ContextAttention(
        cp_group, index, torch.argsort(order), DOCS if mask == "block_causal" else None, "sdpa"
    )
    local_loss, local_grad = embeddings_grad(
        model,
        lambda m: m(
            tokens[:, index], labels[:, index], loss_fn, positions=pos, attention=attention
        ),
    )

    loss = local_loss.clone()
    dist.all_reduce(loss, group=cp_group)
    assert torch.allclose(loss, want_loss, rtol=1e-5), (loss, want_loss)
    parts = [torch.empty_like(local_grad) for _ in range(2)]
    dist.all_gather(parts, local_grad.contiguous(), group=cp_group)
    grad = torch.cat(parts, dim=1)[:, torch.argsort(order)]
    scale = want_grad.abs().max()
    assert (grad - want_grad).abs().max() <= 1e-5 * scale, (grad - want_grad).abs().max()
    others = DOCS[0] != 1 if mask == "block_causal" else torch.arange(SEQ) >= 40
    local_others = others[index]
    assert torch.count_nonzero(local_grad[0, local_others]) == 0, (
        f"rank {rank}: another document's embeddings got a gradient"
    )
    assert (local_grad[0, DOCS[0, index] == 1].abs().sum(-1) > 0).all()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        # FSDP averaged over the 2 cp ranks: the sum is twice that
        assert torch.allclose(2 * g, q.grad, atol=1e-5 * max(1.0, float(q.grad.abs().max()))), name
    if rank == 0:
        print(f"cp probe ok {mask}", flush=True)


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    for mask in ("causal", "block_causal"):
        run(mask)
