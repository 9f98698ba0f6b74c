"""float8 experts (`float8.moe = true`): a MoE layer's grouped GEMMs in rowwise-scaled float8.

The experts' forward `x @ w1^T`, `x @ w3^T`, `h @ w2^T` and the backward's input gradients
`dy @ w` run as float8 (e4m3) grouped GEMMs with one scale per row of the activation and one
per output column of each expert's weight (rowwise: an outlier costs precision only in its own
row), accumulated in fp32 and written in the compute dtype (`torch._scaled_grouped_mm`, CUDA sm
90). The weight gradients `dy_e^T @ x_e` stay in the compute dtype: their contraction runs over
each expert's tokens, whose scales would have to be per expert group (jagged); torchao computes
them in float8 with Triton kernels of its own, this trainer keeps them exact, so float8 speeds
two thirds of the experts' GEMM FLOPs.

Every expert's rows are padded to a multiple of 16 (`ALIGN`, the float8 kernels' alignment) in
a buffer of static size rows + 16 x E (no host sync: the positions are computed on the device);
padding rows are zero, so they add nothing to any gradient, and are dropped on the way out.

`float8.moe_emulate = true` runs the same quantization with the GEMM in fp32 on dequantized
values (any device, for tests of the numerics on the CPU); it is never chosen silently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.distributed import log0
from trainer.models.common.moe import GroupedExperts, moe_layers

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16


def quantize_rows(t: torch.Tensor):
    """(float8 e4m3 values, fp32 decode scales over the last dim): t ~= q x scale[..., None]."""
    amax = t.detach().abs().amax(-1).float().clamp_min(1e-12)
    scale = amax / E4M3_MAX
    q = (t.float() / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def scaled_grouped_mm(a, a_scale, b_q, b_scale, offs, out_dtype, emulate: bool):
    """Per expert group g of `a`'s rows (ends `offs`): a_g @ b_q[g] with a [M, K] float8 rows
    scaled by a_scale [M], b_q [E, K, N] (a column-major view) scaled by b_scale [E, N]."""
    if emulate:
        a_f = a.float() * a_scale[:, None]
        b_f = b_q.float() * b_scale[:, None, :]
        return torch._grouped_mm(a_f, b_f, offs=offs).to(out_dtype)
    return torch._scaled_grouped_mm(
        a, b_q, a_scale, b_scale, offs=offs, out_dtype=out_dtype, use_fast_accum=True
    )


class _Float8GroupedLinear(torch.autograd.Function):
    """y = x @ w[g]^T per group: float8 forward and input gradient, exact weight gradient."""

    @staticmethod
    def forward(ctx, x, w, offs, emulate: bool):
        ctx.save_for_backward(x, w, offs)
        ctx.emulate = emulate
        xq, xs = quantize_rows(x)
        wq, ws = quantize_rows(w)  # [E, N, K] over K: one scale per output column
        return scaled_grouped_mm(xq, xs, wq.transpose(-2, -1), ws, offs, x.dtype, emulate)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        gq, gs = quantize_rows(dy)
        wtq, wts = quantize_rows(w.transpose(-2, -1).contiguous())  # [E, K, N] over N
        dx = scaled_grouped_mm(gq, gs, wtq.transpose(-2, -1), wts, offs, x.dtype, ctx.emulate)
        dw = torch._grouped_mm(dy.t(), x, offs=offs).to(w.dtype)  # [E, N, K], per group
        return dx, dw, None, None


def padded_layout(counts: torch.Tensor, rows: int):
    """(dest [rows]: each row's place in the padded buffer, offs [E] int32: the padded groups'
    ends, size: the buffer's static size). Rows past sum(counts) (capacity's padding) go after
    the last group, where no GEMM reads them."""
    e = counts.numel()
    tail = (rows - counts.sum()).reshape(1)
    ext = torch.cat([counts, tail])
    padded = (ext + ALIGN - 1) // ALIGN * ALIGN
    pstart = padded.cumsum(0) - padded
    start = ext.cumsum(0) - ext
    group = torch.repeat_interleave(
        torch.arange(e + 1, device=counts.device), ext, output_size=rows
    )
    dest = pstart[group] + torch.arange(rows, device=counts.device) - start[group]
    offs = padded[:e].cumsum(0).to(torch.int32)
    return dest, offs, rows + ALIGN * (e + 1)


class Float8GroupedExperts(GroupedExperts):
    """GroupedExperts whose GEMMs run in rowwise float8 (the same parameters and names)."""

    emulate = False

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.w1, self.w2, self.w3
        if hasattr(w1, "to_local"):  # expert parallel: this rank's experts
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
        dest, offs, size = padded_layout(counts, x.shape[0])
        xp = x.new_zeros(size, x.shape[1]).index_copy(0, dest, x)
        mm = _Float8GroupedLinear.apply
        h = F.silu(mm(xp, w1, offs, self.emulate)) * mm(xp, w3, offs, self.emulate)
        out = mm(h, w2, offs, self.emulate)[dest]
        return out.masked_fill((dest >= offs[-1]).unsqueeze(-1), 0)  # capacity's padding rows


def apply_float8_experts(model, emulate: bool) -> int:
    """Swap every MoE layer's experts to float8 in place (before EP, TP, AC, compile and FSDP;
    parameter names unchanged). Returns how many layers were swapped."""
    layers = moe_layers(model)
    for moe in layers.values():
        moe.experts.__class__ = Float8GroupedExperts
        moe.experts.emulate = emulate
    log0(
        f"float8 experts: {len(layers)} MoE layers as rowwise float8 grouped GEMMs (forward and "
        f"input gradients; weight gradients exact){', emulated in fp32' if emulate else ''}"
    )
    return len(layers)
