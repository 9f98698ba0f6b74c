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

`training.z_loss_weight` w > 0 adds the z-loss of PaLM and OLMo 2, w * logsumexp(logits)^2 per
non-ignored token, to the summed loss (so the loop normalises it by the global token count,
as the cross-entropy). `eager` computes it with autograd (one more fp32 [tokens, vocab] tensor
saved for the backward); `chunked` from the lse it already has, adding 2 * w * lse * softmax
to each chunk's d loss / d logits. The z term is also kept apart (`Loss.take_z_loss`) for the
`loss_metrics/z_loss` metric. With w = 0 (default) nothing of it is computed: the results are
those of the plain cross-entropy, bit for bit.

The fp32 results equal eager's to rounding (tests/test_loss.py: <= 1e-5 relative). The loss
is computed inside the output head's forward (trainer.models.common.decoder.Head), so FSDP's
all-gather of
the head, its reshard and the reduce-scatter of dW behave as for the plain nn.Linear: the
pre-backward hook fires on the loss, the post-backward hook after dh reaches the final norm.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from trainer.parallel.loss_parallel import vocab_parallel_chunk

IGNORE_INDEX = -100


def eager_loss_and_z(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    z_loss_weight: float = 0.0,
    split_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed token cross-entropy + z_loss_weight * z, z) through full fp32 logits, where
    z = the sum of logsumexp(logits)^2 over the non-ignored tokens (None when the weight is 0).
    Autograd's own backward runs twice when asked (`split_backward` changes nothing)."""
    logits = F.linear(hidden, weight).flatten(0, -2).float()
    targets = labels.flatten()
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    if not z_loss_weight:
        return loss, None
    lse = torch.logsumexp(logits, dim=-1)
    z = torch.where(targets != IGNORE_INDEX, lse.square(), 0.0).sum()
    return loss + z_loss_weight * z, z


def eager_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy through full fp32 logits (the reference)."""
    return eager_loss_and_z(hidden, weight, labels)[0]


def chunk_loss_and_grad(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    want_grad: bool,
    z_loss_weight: float = 0.0,
):
    """One chunk: (summed fp32 cross-entropy, summed lse^2 or None when z_loss_weight is 0,
    d (cross-entropy + z_loss_weight * lse^2) / d logits in the compute dtype, or None)."""
    logits = F.linear(h, weight).float()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)[:, None]
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    z = torch.where(valid, lse.square(), 0.0).sum() if z_loss_weight else None
    if not want_grad:
        return loss, z, None
    grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    if z_loss_weight:  # d (w * lse^2) / d logits = 2 * w * lse * softmax
        grad.mul_((1.0 + 2.0 * z_loss_weight * lse)[:, None])
    grad.scatter_add_(1, target, -valid[:, None].to(grad.dtype))  # minus one-hot
    grad.mul_(valid[:, None])  # ignored tokens have no gradient
    return loss, z, grad.to(h.dtype)


_FP32_OUT_ADDMM: dict[torch.device, bool] = {}


def _fp32_out_addmm(device: torch.device) -> bool:
    """Whether this device's addmm takes bf16/fp16 inputs with an fp32 accumulator (cuBLAS,
    `out_dtype`, torch >= 2.9 on CUDA); asked once per device."""
    if device not in _FP32_OUT_ADDMM:
        ok = device.type == "cuda"
        if ok:
            acc = torch.zeros(2, 2, device=device)
            a = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
            try:
                torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
                ok = bool((acc == 2).all())
            except (TypeError, RuntimeError, NotImplementedError):
                ok = False
        _FP32_OUT_ADDMM[device] = ok
    return _FP32_OUT_ADDMM[device]


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b. Low-precision inputs go through one GEMM with an fp32 accumulator
    on CUDA (the chunked loss's head-weight gradient: a separate fp32 add of each chunk's
    [vocab, dim] product cost 28 ms of a 500 ms 1B step on an H200); elsewhere, where no
    mixed-dtype addmm exists, the product is formed in the inputs' dtype and added in fp32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _fp32_out_addmm(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += torch.mm(a, b)


def _book_as_gradient(t: torch.Tensor) -> None:
    """Under the traced dry run (a fake mode with `book_as`: trainer/plan/fake.py) the head's
    weight gradient, made in the forward, is booked as a gradient, not an activation: it has
    the weight's size whatever the microbatch's (no cp or batch split shrinks it)."""
    mode = getattr(t, "fake_mode", None)
    if mode is not None and hasattr(mode, "book_as"):
        mode.book_as(t, "gradients")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients in the forward, chunk by chunk; the backward scales them.
    Returns (cross-entropy + z_loss_weight * z, z): z, the summed lse^2, has no gradient and
    is None when z_loss_weight is 0."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        chunk_size: int,
        chunk_fn,
        z_loss_weight: float,
        split_backward: bool = False,
    ):
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        _book_as_gradient(grad_w)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        z_sum = torch.zeros_like(loss) if z_loss_weight else None
        for start in range(0, h.shape[0], chunk_size):
            hc = h[start : start + chunk_size]
            chunk, z, g = chunk_fn(hc, weight, y[start : start + chunk_size], True, z_loss_weight)
            loss += chunk
            if z is not None:
                z_sum += z
            torch.mm(g, weight, out=grad_h[start : start + chunk_size])
            add_product(grad_w, g.t(), hc)
            del g
        if z_sum is not None:
            loss = loss + z_loss_weight * z_sum
            ctx.mark_non_differentiable(z_sum)
        ctx.grads = (grad_h.view(hidden.shape), grad_w)
        ctx.weight_dtype, ctx.split_backward = weight.dtype, split_backward
        return loss, z_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_z):
        grad_h, grad_w = ctx.grads
        rest = (None,) * 5
        if ctx.split_backward:  # called again for the weights (zero-bubble pipelines): keep them
            return (
                grad_h * grad_loss.to(grad_h.dtype),
                (grad_w * grad_loss).to(ctx.weight_dtype),
                *rest,
            )
        del ctx.grads
        return (
            grad_h.mul_(grad_loss.to(grad_h.dtype)),
            grad_w.mul_(grad_loss).to(ctx.weight_dtype),
            *rest,
        )


def chunked_loss_and_z(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    chunk_fn=chunk_loss_and_grad,
    z_loss_weight: float = 0.0,
    split_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """eager_loss_and_z's results, `chunk_size` tokens at a time (see the module docstring).
    `split_backward`: the backward may run twice, for the input and then for the weight
    gradient (zero-bubble pipeline schedules): the gradients are kept until the graph goes."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(
            hidden, weight, labels, chunk_size, chunk_fn, z_loss_weight, split_backward
        )
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    z_sum = torch.zeros_like(loss) if z_loss_weight else None
    for start in range(0, h.shape[0], chunk_size):
        chunk, z, _ = chunk_fn(
            h[start : start + chunk_size],
            weight,
            y[start : start + chunk_size],
            False,
            z_loss_weight,
        )
        loss += chunk
        if z is not None:
            z_sum += z
    return (loss, None) if z_sum is None else (loss + z_loss_weight * z_sum, z_sum)


def chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    chunk_fn=chunk_loss_and_grad,
) -> torch.Tensor:
    """Summed token cross-entropy, `chunk_size` tokens at a time (see the module docstring)."""
    return chunked_loss_and_z(hidden, weight, labels, chunk_size=chunk_size, chunk_fn=chunk_fn)[0]


class Loss:
    """The loss the model's head computes: called as (hidden, weight, labels), it returns the
    summed fp32 token loss, cross-entropy plus `z_loss_weight` * the summed lse^2. With a
    z-loss it also keeps that term (weighted, detached) of its calls until `take_z_loss()`.
    `vocab_parallel`: it takes this tp rank's vocab shard of the weight (loss parallel)."""

    def __init__(self, fn, z_loss_weight: float = 0.0, vocab_parallel: bool = False):
        self.fn, self.z_loss_weight, self.vocab_parallel = fn, z_loss_weight, vocab_parallel
        self._z_loss: torch.Tensor | None = None
        self._mtp: torch.Tensor | None = None  # the MTP heads' summed loss (MTPLoss)
        self.split_backward = False  # a zero-bubble pipeline schedule sets it

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        loss, z = self.fn(
            hidden,
            weight,
            labels,
            z_loss_weight=self.z_loss_weight,
            **({"split_backward": True} if self.split_backward else {}),
        )
        if z is not None:
            term = self.z_loss_weight * z.detach()
            self._z_loss = term if self._z_loss is None else self._z_loss + term
        return loss

    def take_z_loss(self) -> torch.Tensor | None:
        """The summed z-loss term of the calls since the last take; None without a z-loss."""
        z, self._z_loss = self._z_loss, None
        return z

    def for_mtp(self) -> "MTPLoss":
        """The loss of the multi-token prediction heads (trainer/models/common/mtp.py)."""
        return MTPLoss(self)

    def take_mtp_loss(self) -> torch.Tensor | None:
        """The MTP heads' summed token cross-entropy since the last take (every depth); None
        without MTP."""
        mtp, self._mtp = self._mtp, None
        return mtp


class MTPLoss:
    """The MTP heads' loss: the cross-entropy alone (no z-loss), its sum kept apart in the
    training Loss for `loss_metrics/mtp_loss`."""

    def __init__(self, loss: Loss):
        self.loss, self.vocab_parallel = loss, loss.vocab_parallel

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        kw = {"split_backward": True} if self.loss.split_backward else {}
        value, _ = self.loss.fn(hidden, weight, labels, z_loss_weight=0.0, **kw)
        seen = self.loss._mtp
        self.loss._mtp = value.detach() if seen is None else seen + value.detach()
        return value


class RowLoss:
    """A Loss per row: called as (hidden [B, S, dim], weight, labels [B, S]), it returns the
    summed token loss of each row, fp32 [B], one row (and one chunk of its tokens) at a time,
    so that scoring (evals) never holds more than one chunk's logits either. Loss parallel
    goes through as it does for the wrapped loss."""

    def __init__(self, loss: Loss):
        self.loss, self.vocab_parallel = loss, loss.vocab_parallel

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        return torch.stack(
            [
                self.loss(hidden[i : i + 1], weight, labels[i : i + 1])
                for i in range(hidden.shape[0])
            ]
        )


def scoring_loss(chunk_size: int, vocab_parallel_group=None) -> Loss:
    """The loss validation and evals score with: training's chunked head (no z-loss), so
    that neither ever makes the [tokens, vocab] logits of a whole batch."""
    return build_loss("chunked", chunk_size, vocab_parallel_group=vocab_parallel_group)


def build_loss(
    kind: str,
    chunk_size: int,
    *,
    z_loss_weight: float = 0.0,
    compile_chunks: bool = False,
    vocab_parallel_group=None,
) -> Loss:
    """The loss `[training] loss` names, with `training.z_loss_weight`. `compile_chunks`
    compiles the chunk's elementwise work (upcast, logsumexp, softmax, one-hot) into fused
    kernels: for `[compile] enable`.

    `vocab_parallel_group`: the tp process group of loss parallel (trainer/parallel/
    loss_parallel.py). Its chunks all-reduce softmax statistics over the group (not compiled:
    a collective inside would break the graph); `eager` is then one chunk of all the tokens,
    the same [tokens, vocab / tp] logits at once."""
    if vocab_parallel_group is not None:
        chunk_fn = functools.partial(vocab_parallel_chunk, group=vocab_parallel_group)
        size = chunk_size if kind == "chunked" else sys.maxsize
        return Loss(
            functools.partial(chunked_loss_and_z, chunk_size=size, chunk_fn=chunk_fn),
            z_loss_weight,
            vocab_parallel=True,
        )
    if kind == "eager":
        return Loss(eager_loss_and_z, z_loss_weight)
    if kind != "chunked":
        raise ValueError(f"unknown loss {kind!r}")
    chunk_fn = torch.compile(chunk_loss_and_grad) if compile_chunks else chunk_loss_and_grad
    return Loss(
        functools.partial(chunked_loss_and_z, chunk_size=chunk_size, chunk_fn=chunk_fn),
        z_loss_weight,
    )
