"""The training loss: output projection + cross-entropy, summed over the non-ignored tokens.

`[training] loss` picks how it is computed from the final hidden states h [tokens, dim] and
the output weight W [vocab, dim] (both in the compute dtype):

- `eager`: logits = h @ W^T for every token ([tokens, vocab] in the compute dtype), upcast to
  fp32, then F.cross_entropy. Autograd keeps the logits and the fp32 log-probabilities alive
  through the backward: at Llama-3's vocab and 8k tokens per microbatch that is ~6 GiB in
  bf16 + fp32, and ~14 GiB at the peak of the loss's backward.
- `chunked` (default): the same sums, `loss_chunk_size` tokens at a time. Each chunk's logits
  are computed, reduced to the loss (logsumexp minus the target logit, in fp32) and, when a
  gradient is wanted, turned at once into the chunk's gradient: softmax minus one-hot (zero on
  ignored tokens), cast to the compute dtype, times W for dh and accumulated into an fp32 dW.
  Only dh ([tokens, dim]) and dW ([vocab, dim], fp32) live until the backward, which just
  scales them by the incoming gradient. No [tokens, vocab] tensor outlives its chunk, and no
  logits are recomputed (the same three matmuls as eager).

The fp32 results equal eager's to rounding (tests/test_loss.py: <= 1e-5 relative). The loss
is computed inside the output head's forward (trainer.model.Head), so FSDP's all-gather of the
head, its reshard and the reduce-scatter of dW behave as for the plain nn.Linear: the
pre-backward hook fires on the loss, the post-backward hook after dh reaches the final norm.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def eager_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy through full fp32 logits (the reference)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def chunk_loss_and_grad(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: (summed fp32 loss, d loss / d logits in the compute dtype or None)."""
    logits = F.linear(h, weight).float()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)[:, None]
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if not want_grad:
        return loss, None
    probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    probs.scatter_add_(1, target, -valid[:, None].to(probs.dtype))  # minus one-hot
    probs.mul_(valid[:, None])  # ignored tokens have no gradient
    return loss, probs.to(h.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients in the forward, chunk by chunk; the backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, chunk_fn):
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk_size):
            hc = h[start:start + chunk_size]
            chunk, g = chunk_fn(hc, weight, y[start:start + chunk_size], True)
            loss += chunk
            torch.mm(g, weight, out=grad_h[start:start + chunk_size])
            if g.dtype == torch.float32:
                grad_w.addmm_(g.t(), hc)
            else:  # no mixed-dtype addmm: accumulate each chunk's product in fp32
                grad_w += torch.mm(g.t(), hc)
            del g
        ctx.grads = (grad_h.view(hidden.shape), grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.grads
        del ctx.grads
        return (grad_h.mul_(grad_loss.to(grad_h.dtype)),
                grad_w.mul_(grad_loss).to(ctx.weight_dtype), None, None, None)


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                 chunk_size: int, chunk_fn=chunk_loss_and_grad) -> torch.Tensor:
    """Summed token cross-entropy, `chunk_size` tokens at a time (see the module docstring)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size, chunk_fn)
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_size):
        total += chunk_fn(h[start:start + chunk_size], weight, y[start:start + chunk_size],
                          False)[0]
    return total


def build_loss(kind: str, chunk_size: int, *, compile_chunks: bool = False) -> LossFn:
    """The loss `[training] loss` names. `compile_chunks` compiles the chunk's elementwise
    work (upcast, logsumexp, softmax, one-hot) into fused kernels: for `[compile] enable`."""
    if kind == "eager":
        return eager_loss
    if kind != "chunked":
        raise ValueError(f"unknown loss {kind!r}")
    chunk_fn = torch.compile(chunk_loss_and_grad) if compile_chunks else chunk_loss_and_grad

    def loss(hidden, weight, labels):
        return chunked_loss(hidden, weight, labels, chunk_size=chunk_size, chunk_fn=chunk_fn)

    return loss
