"""Attention with sinks, over causal, block-causal and sliding-window masks (gpt-oss).

A sink is a learned logit per head that joins every softmax row as one more (value-less)
column: p_ij = exp(s_ij) / (exp(sink) + sum_j exp(s_ij)), so a row's probabilities over the
keys sum to less than one. With the row's log-sum-exp lse_i = log sum_j exp(s_ij), which the
kernels return, that is the plain attention's output times w_i = sigmoid(lse_i - sink):
exact, with no extra score column.

The backward needs nothing new from the kernel. With g the gradient of the sinked output
o' = w o: the sink's gradient is -sum_i (g_i . o'_i)(1 - w_i), and q, k, v's are the plain
kernel's backward for the output gradient g w, given o' in place of o. (The kernel's backward
uses o only for D_i = rowsum(dO_i o_i), and the lse's own gradient, p_ij (g_i . o_i) w_i
(1 - w_i) on each score, is exactly what replacing o by o' subtracts from D_i.)

Kernels:
- CPU: torch's flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, which
  returns the lse) with an additive mask, and its backward (`SinkAttention`).
- CUDA: compiled FlexAttention with `return_lse` (its lse has a gradient), the mask as a
  BlockMask from the mask's own rule (causal, documents, window): tiles outside are skipped.
  Written for CUDA and not yet run there (docs/gpt_oss.md).

Masks (`Masks`): one per microbatch, shared by every layer, built lazily for each window the
layers use (gpt-oss: 0, the whole causal window, and sliding_window): a query i sees key j
when j <= i, i - j < window (if any), and, under block_causal, j is in i's document. Under
context parallelism the layer gets the cp attention instead and narrows its [local, global]
mask by the window from the rank's global positions (`cp_allowed`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from trainer.models.common import logits


class SinkAttention(torch.autograd.Function):
    """CPU: o' = flash(q, k, v, mask) x sigmoid(lse - sink) (see the module docstring).
    q, k, v [b, h, s or S, d] (k and v with as many heads as q), sinks [h], mask: an additive
    float mask broadcastable to [b, h, s, S], or None for plain causal."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask):
        causal = mask is None
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask
        )
        w = torch.sigmoid(lse - sinks.float()[None, :, None])  # [b, h, s]
        sinked = (out.float() * w[..., None]).to(out.dtype)
        ctx.save_for_backward(q, k, v, sinks, mask, lse, sinked, w)
        ctx.causal = causal
        return sinked

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks, mask, lse, sinked, w = ctx.saved_tensors
        g = grad.float()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            (g * w[..., None]).to(q.dtype), q, k, v, sinked, lse, 0.0, ctx.causal, attn_mask=mask
        )
        along = (g * sinked.float()).sum(-1) * (1 - w)  # [b, h, s]
        dsinks = -along.sum(dim=(0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None


def attend(q, k, v, sinks, allowed):
    """Attention with sinks: q [b, s, h, d], k and v [b, S, kv_heads, d], sinks [h] (this
    rank's heads); `allowed` the pairs a query sees: a FlexAttention BlockMask (CUDA), a
    boolean mask broadcastable to [b, 1, s, S], or None (plain causal, queries and keys the
    same positions) -> [b, h, s, d]."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if allowed is not None and not isinstance(allowed, torch.Tensor):
        out, lse = _compiled_flex()(
            q, k, v, block_mask=allowed, enable_gqa=groups > 1, return_lse=True
        )
        w = torch.sigmoid(lse - sinks.float()[None, :, None])
        return (out.float() * w[..., None]).to(out.dtype)
    if groups > 1:  # the CPU kernel takes as many key heads as query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = None
    if allowed is not None:
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~allowed, float("-inf"))
    return SinkAttention.apply(q, k, v, sinks, mask)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask(mask_mod, batch: int | None, q_len: int, kv_len: int, device):
    """A BlockMask of `mask_mod` built by the compiled create_block_mask (tile by tile, no
    [b, s, s] boolean)."""
    from trainer.models.common.attention import _compiled_create_block_mask

    return _compiled_create_block_mask()(mask_mod, batch, None, q_len, kv_len, device=device)


def allowed_pairs(allowed) -> callable | None:
    """QK-clip's `allowed(rows)` (trainer/models/common/logits.py) of a mask as `attend`
    takes it."""
    if allowed is None:
        return None
    if isinstance(allowed, torch.Tensor):
        return logits.boolean(allowed)
    return logits.block_mask(allowed)


class Masks:
    """One microbatch's masks for every layer (see the module docstring), built once per
    window: `for_window(window)` is, on CUDA, a BlockMask; on the CPU a boolean
    [b or 1, 1, s, s], or None for plain causal without a window."""

    def __init__(self, seq: int, doc_ids: torch.Tensor | None, device):
        self.seq, self.doc_ids, self.device = seq, doc_ids, torch.device(device)
        self._built: dict[int, object] = {}

    def for_window(self, window: int):
        if window not in self._built:
            cuda = self.device.type == "cuda"
            self._built[window] = self._block_mask(window) if cuda else self._boolean(window)
        return self._built[window]

    def _block_mask(self, window: int):
        docs = self.doc_ids

        def mask_mod(b, h, q_idx, kv_idx):
            ok = kv_idx <= q_idx
            if window:
                ok = ok & (q_idx - kv_idx < window)
            if docs is not None:
                ok = ok & (docs[b, q_idx] == docs[b, kv_idx])
            return ok

        batch = None if docs is None else docs.shape[0]
        return block_mask(mask_mod, batch, self.seq, self.seq, self.device)

    @torch.no_grad()
    def _boolean(self, window: int):
        if not window and self.doc_ids is None:
            return None
        idx = torch.arange(self.seq, device=self.device)
        ok = idx[None, :] <= idx[:, None]
        if window:
            ok = ok & (idx[:, None] - idx[None, :] < window)
        ok = ok[None]
        if self.doc_ids is not None:
            ok = ok & (self.doc_ids[:, :, None] == self.doc_ids[:, None, :])
        return ok.unsqueeze(1)


def cp_allowed(cp, window: int):
    """Under context parallelism (trainer/parallel/context_parallel.py's ContextAttention):
    its [local, global] mask (causal and documents, by global position) narrowed to `window`
    from this rank's global positions (recovered from the gather's order: rank r's tokens
    are the r-th block of the rank-major gather); on CUDA as a BlockMask over the narrowed
    boolean. Built once per microbatch and window (kept on the cp attention)."""
    built = cp.__dict__.setdefault("_windows", {})
    if window not in built:
        built[window] = _cp_mask(cp, window)
    return built[window]


@torch.no_grad()
def _cp_mask(cp, window: int):
    mask, device = cp.mask, cp.natural.device
    if not isinstance(mask, torch.Tensor):  # CUDA: the BlockMask's rule, on the grid
        if not window:
            return mask
        mask = logits.block_mask(mask)(torch.arange(mask.shape[-2], device=device))
    elif not window:
        return mask
    seq, local = cp.natural.numel(), mask.shape[-2]
    rank = dist.get_rank(cp.group)
    gathered = torch.empty_like(cp.natural)
    gathered[cp.natural] = torch.arange(seq, device=device)
    index = gathered[rank * local : (rank + 1) * local]  # this rank's global positions
    keys = torch.arange(seq, device=device)
    narrowed = mask & (index[:, None] - keys[None, :] < window)
    if device.type != "cuda":
        return narrowed
    batch = narrowed.shape[0]

    def lookup(b, h, q_idx, kv_idx):
        return narrowed[b if batch > 1 else 0, 0, q_idx, kv_idx]

    return block_mask(lookup, batch if batch > 1 else None, local, seq, device)
