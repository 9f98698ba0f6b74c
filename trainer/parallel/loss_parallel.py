"""The output head under tensor parallelism: its weight [vocab, dim] is sharded on the vocab
over the `tp` mesh dimension (colwise, as Megatron's and torchtitan's head; a tied embedding is
rowwise-sharded the same way), so each tp rank computes the logits of vocab / tp columns.

Loss parallel (default): the cross-entropy is computed from those vocab-sharded logits, never
gathering the full vocabulary. Per chunk of tokens (trainer/models/common/loss.py's chunked loss,
whose structure this reuses), each rank computes its [tokens, vocab / tp] logits in fp32, and two
all-reduces over tp finish the softmax statistics: the max of each row (MAX), then the sum of
exp(logit - max) and the target's logit, which only the rank holding the target's column has (SUM).
From them every rank has the same loss, and its own columns of d loss / d logits (softmax minus
one-hot). The hidden states' gradient `d logits @ W_shard` is then a partial sum over tp (each rank
saw vocab / tp columns): the hidden states enter as a Partial-gradient view of the sequence-gathered
activations, so DTensor reduce-scatters that gradient back to the sequence shards. The weight's
gradient is local to its shard.

`parallelism.disable_loss_parallel` computes the plain loss on every tp rank over the gathered
weight instead (the weight is [vocab, dim]; gathering the [tokens, vocab] logits, as
torchtitan's variant does, would cost more). Logits without labels (evals, validation) are
gathered over tp: a [batch, seq, vocab] tensor of a small evaluation batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

# trainer.models.common.loss.IGNORE_INDEX (not imported: loss.py imports this module)
IGNORE_INDEX = -100


def vocab_parallel_project(h, weight: DTensor, labels=None, loss_fn=None) -> torch.Tensor:
    """The head's result for a vocab-sharded `weight` (DTensor on the tp mesh) and hidden
    states `h` (sequence-sharded DTensor under sequence parallelism, or replicated)."""
    mesh = weight.device_mesh
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    h = h.redistribute(placements=[Replicate()])  # all-gather the sequence
    if labels is None:
        logits = F.linear(h.to_local(), weight.to_local())
        return DTensor.from_local(logits, mesh, [Shard(-1)], run_check=False).full_tensor()
    if getattr(loss_fn, "vocab_parallel", False):
        return loss_fn(h.to_local(grad_placements=[Partial()]), weight.to_local(), labels)
    return loss_fn(h.to_local(), weight.full_tensor(), labels)


def vocab_parallel_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    want_grad: bool,
    z_loss_weight: float = 0.0,
    *,
    group,
):
    """trainer.models.common.loss.chunk_loss_and_grad for a weight shard of vocab / tp rows (this
    rank's rows are [rank * n, (rank + 1) * n) of the vocab): the same (loss, z, grad) contract,
    with grad holding only this rank's columns. Every tp rank returns the same loss and z."""
    logits = F.linear(h, weight).float()
    n, start = weight.shape[0], dist.get_rank(group) * weight.shape[0]
    valid = labels != IGNORE_INDEX
    mine = valid & (labels >= start) & (labels < start + n)
    target = torch.where(mine, labels - start, 0)[:, None]
    row_max = logits.detach().amax(dim=-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    picked = torch.where(mine, logits.gather(1, target).squeeze(1), 0.0)
    probs = logits.sub_(row_max[:, None]).exp_()  # exp(logit - max), in place of the logits
    stats = torch.stack([probs.sum(-1), picked])
    dist.all_reduce(stats, group=group)
    sum_exp, picked = stats[0], stats[1]
    lse = row_max + sum_exp.log()
    loss = torch.where(valid, lse - picked, 0.0).sum()
    z = torch.where(valid, lse.square(), 0.0).sum() if z_loss_weight else None
    if not want_grad:
        return loss, z, None
    grad = probs.div_(sum_exp[:, None])  # this rank's columns of the softmax
    if z_loss_weight:  # d (w * lse^2) / d logits = 2 * w * lse * softmax
        grad.mul_((1.0 + 2.0 * z_loss_weight * lse)[:, None])
    grad.scatter_add_(1, target, -mine[:, None].to(grad.dtype))  # minus one-hot (if mine)
    grad.mul_(valid[:, None])  # ignored tokens have no gradient
    return loss, z, grad.to(h.dtype)
