"""Muon for the matrices of the transformer blocks, AdamW for the rest: one optimizer, exact on
every layout.

The math is `torch.optim.Muon`'s, step for step: the momentum buffer is an EMA of the gradient
(`buf.lerp_(grad, 1 - momentum)`), the update is `grad.lerp(buf, momentum)` with Nesterov (the
buffer without), orthogonalized by the quintic Newton-Schulz iteration (3.4445, -4.775, 2.0315;
`ns_steps`, in `ns_dtype`: bf16 as torch's always is), weight decay decoupled
(`p *= 1 - lr * wd`), and the lr scaled by the matrix's shape: `match_rms_adamw` 0.2 *
sqrt(max(A, B)) (AdamW's lr carries over), `original` sqrt(max(1, A/B)), `none` 1. Which
parameters take Muon: every parameter of a block (`layers.*`) with two or more dims; a stacked
`[E, out, in]` expert tensor is E matrices. The embedding, the output head and every 1-D
parameter take AdamW (torch's, with the `[optimizer]` AdamW keys), in the same optimizer: one
state dict, one lr schedule.

Distributed: Newton-Schulz of a shard is not the shard of Newton-Schulz, so each matrix is
orthogonalized whole, on one owner rank, the owners spread so every rank of the mesh runs a
balanced share of the FLOPs: two all-to-alls per bucket of matrices on one mesh, the updates'
shards to the owners and the results' shards back (trainer/optim/muon_dist.py). Parameters
and their momentum buffers are DTensors over FSDP/HSDP, TP and EP meshes, sharded alike; the
lr scale uses the whole matrix's shape. Under PP each stage's ranks own its matrices.

A step skipped on the device (`found_inf`, as the fused AdamW takes it) leaves parameters and
momentum untouched without a host sync: the new values are committed through `torch.where`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.optim.muon_dist import Layout, flat_groups, mesh_ranks, orthogonalize_sharded

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
BUCKET_BYTES = 512 * 2**20  # per rank: fp32 bytes of whole matrices an owner holds at once
LR_ADJUST = ("match_rms_adamw", "original", "none")
NS_DTYPES = ("bfloat16", "float32")


def takes_muon(name: str, param) -> bool:
    """A block's matrix (attention, FFN, router, shared and routed experts); `param` a tensor
    or a shape."""
    return ".layers." in f".{name}" and len(param.shape if hasattr(param, "shape") else param) >= 2


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization of one matrix, in `dtype` (the same ops in the same
    order: bitwise equal to torch's in bf16)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalize(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of a matrix, or of each matrix of a stack `[E, out, in]`."""
    if g.ndim == 2:
        return newton_schulz(g, steps, dtype)
    return torch.stack([newton_schulz(m, steps, dtype) for m in g.flatten(0, -3)]).view(g.shape)


def lr_scale(adjust: str, shape) -> float:
    """The shape's lr factor (of each matrix: a stack's last two dims)."""
    rows, cols = shape[-2], shape[-1]
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


class Muon(torch.optim.Optimizer):
    """Param group 0: Muon's matrices (`use_muon`); the rest: AdamW's groups, stepped by a
    `torch.optim.AdamW` that shares this optimizer's groups and state."""

    def __init__(self, muon_params, adamw: torch.optim.AdamW | None, *, lr: float, weight_decay: float,
                 momentum: float, nesterov: bool, ns_steps: int, lr_adjust: str,
                 ns_dtype: str):
        groups = [{"params": list(muon_params), "use_muon": True}]
        for g in adamw.param_groups if adamw else []:  # the same dicts: the lr reaches AdamW
            g["use_muon"] = False
            groups.append(g)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, lr_adjust=lr_adjust, ns_dtype=ns_dtype,
                        fused=bool(adamw is None or adamw.defaults.get("fused")))
        super().__init__(groups, defaults)
        self._adamw = adamw
        self._groups = flat_groups([p.device_mesh for p in groups[0]["params"]
                                    if isinstance(p, DTensor)]) if dist.is_initialized() else {}
        self._layouts: dict = {}

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adamw.state = self.state  # shared (a load_state_dict replaces both)
            if found_inf is not None:
                self._adamw.found_inf = found_inf
            try:
                self._adamw.step()
            finally:
                self._adamw.__dict__.pop("found_inf", None)
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group, found_inf)

    def _muon_step(self, group: dict, found_inf: torch.Tensor | None) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        dtype = getattr(torch, group["ns_dtype"])
        updates = []
        for p in params:  # elementwise, on each rank's own shard
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
            new_buf = buf.lerp(grad, 1 - group["momentum"])
            updates.append(grad.lerp(new_buf, group["momentum"]) if group["nesterov"]
                           else new_buf)
            _commit(buf, new_buf, found_inf)
        lr, decay = group["lr"], group["weight_decay"]
        for bucket in self._buckets(params):
            results = self._orthogonalized([updates[i] for i in bucket],
                                           [params[i] for i in bucket], group["ns_steps"], dtype)
            for i, o in zip(bucket, results):
                p = params[i]
                new_p = _local(p).mul(1 - lr * decay)
                new_p.add_(o, alpha=-lr * lr_scale(group["lr_adjust"], p.shape))
                _commit(_local(p), new_p, found_inf)

    def _buckets(self, params: list[torch.Tensor]) -> list[list[int]]:
        """Indices of the parameters in buckets of one mesh, ~BUCKET_BYTES of whole fp32
        matrices per rank of the mesh (at least one matrix)."""
        by_mesh: dict = {}
        for i, p in enumerate(params):
            key = (mesh_ranks(p.device_mesh), tuple(p.device_mesh.shape)) \
                if isinstance(p, DTensor) else None
            by_mesh.setdefault(key, []).append(i)
        out = []
        for key, members in by_mesh.items():
            budget = BUCKET_BYTES * (len(key[0]) if key else 1)
            bucket, size = [], 0
            for i in members:
                bucket.append(i)
                size += 4 * params[i].numel()
                if size >= budget:
                    out.append(bucket)
                    bucket, size = [], 0
            if bucket:
                out.append(bucket)
        return out

    def _orthogonalized(self, updates, params, steps: int, dtype) -> list[torch.Tensor]:
        """Each update (a local shard) orthogonalized whole; returns this rank's shards."""
        def fn(full):
            return orthogonalize(full, steps, dtype)

        if not isinstance(params[0], DTensor):
            return [fn(u) for u in updates]
        key = tuple(id(p) for p in params)
        if key not in self._layouts:
            self._layouts[key] = Layout(params, steps)
        layout = self._layouts[key]
        group = self._groups[tuple(sorted(layout.ranks))]
        return orthogonalize_sharded(updates, layout, group, fn, dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _commit(target: torch.Tensor, new: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """target = new, or unchanged where the device says the step is skipped (no host sync)."""
    if found_inf is None:
        target.copy_(new)
    else:
        target.copy_(torch.where(found_inf.to(torch.bool), target, new))


def build_muon(model: torch.nn.Module, cfg, adamw_cls, **adamw_kwargs) -> Muon:
    """Muon over the blocks' matrices, `adamw_cls(**adamw_kwargs)` over the rest."""
    muon, rest = [], []
    for name, p in model.named_parameters():
        (muon if takes_muon(name, p) else rest).append(p)
    adamw = adamw_cls(rest, **adamw_kwargs) if rest else None  # a stage of blocks only
    return Muon(muon, adamw, lr=cfg.lr, weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                ns_steps=cfg.muon_ns_steps, lr_adjust=cfg.muon_lr_adjust,
                ns_dtype=cfg.muon_ns_dtype)
