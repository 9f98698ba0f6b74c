"""Gradient clipping by the global norm over every mesh dimension, accumulated in float64.

torch's `clip_grad_norm_` sums squares in float32: on the CPU the norm of a 2M-element
gradient (the debug model's output head) comes out ~2e-4 too small, and since each rank then
reduces a smaller shard, the logged norm drifted with the layout (1 rank 0.737268, FSDP 2
0.737306, FSDP 4 0.737355, against an exact 0.737416). Here each rank sums the squares of
its local shards in float64, counting a shard that is replicated over some mesh dimensions
(e.g. a norm weight across tp ranks, a parameter across HSDP replicas) once, and one
all-reduce over the world gives the norm: the same value, to float64 rounding, on every
layout. The clip scales every local gradient by min(1, max_norm / (norm + 1e-6)), as torch does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _copies(grad: torch.Tensor, stage_world: int) -> int:
    """How many ranks hold this rank's piece of `grad`: its Replicate mesh dims' sizes
    multiplied, times the ranks of its pipeline stage (`stage_world`) outside its mesh (e.g.
    the tp ranks for a MoE layer's router, which tp does not split: trainer/parallel/tp.py;
    under ep the experts' mesh, (efsdp, ep_dp x tp), holds the tp ranks: no copies there).
    A plain tensor is the same on every rank."""
    if not isinstance(grad, DTensor):
        return dist.get_world_size() if dist.is_initialized() else 1
    mesh = grad.device_mesh
    return (
        stage_world
        // mesh.size()
        * math.prod(
            size for size, p in zip(mesh.shape, grad.placements, strict=True) if p.is_replicate()
        )
    )


def global_grad_norm(params, pp: int = 1) -> torch.Tensor:
    """The 2-norm of all gradients of `params` over the whole mesh of `pp` pipeline stages
    (float32 scalar, the same on every rank; NaN or inf when any gradient is)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    stage_world = (dist.get_world_size() if dist.is_initialized() else 1) // pp
    total = torch.zeros((), dtype=torch.float64, device=device)
    # Grouped by how many ranks hold a piece and by device: one _foreach_norm per group
    # (a few kernels, not several per parameter: ~3,000 of them at 70B).
    groups: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local.numel():
            groups.setdefault((_copies(grad, stage_world), local.device), []).append(local)
    for (copies, _device), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
        total += (torch.stack(norms).square().sum() / copies).to(device)
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.sqrt().float()


def clip_grad_norm_(params, max_norm: float, pp: int = 1) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most `max_norm` (inf: no clip);
    returns the norm before clipping."""
    params = list(params)
    norm = global_grad_norm(params, pp)
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        locals_ = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in params
            if p.grad is not None
        ]
        torch._foreach_mul_(locals_, coef.to(locals_[0].device) if locals_ else coef)
    return norm
