"""torch.optim.Muon's quintic Newton-Schulz orthogonalization, of one matrix or batched over a
stack of same-shape matrices (one bmm / baddbmm chain, not a loop per matrix)."""

from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def orthogonalize(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of a matrix (torch.optim.Muon's ops in its order: bitwise torch's in
    bf16), or of each matrix of a stack `[..., out, in]` in one batched chain (each matrix
    normalized by its own norm; bitwise torch's per-matrix result in bf16 on this CPU), in
    `dtype`. `g` is not modified."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype, copy=True)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=NS_EPS))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x.reshape(-1, *x.shape[-2:])
        if tall and dtype == torch.float32:  # CPU fp32 bmm of a transposed view: ~80x slower;
            x = x.contiguous()  # in bf16 the view keeps torch's per-matrix bits
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS))
        for _ in range(steps):
            gram = torch.bmm(x, x.mT)
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.view(*g.shape[:-2], *x.shape[-2:])
    return x.mT if tall else x
