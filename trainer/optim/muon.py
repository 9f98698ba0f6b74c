"""Muon for the matrices of the transformer blocks, AdamW for the rest: one optimizer, exact on
every layout.

The math is `torch.optim.Muon`'s, step for step: the momentum buffer is an EMA of the gradient
(`buf.lerp_(grad, 1 - momentum)`), the update is `grad.lerp(buf, momentum)` with Nesterov (the
buffer without), orthogonalized by the quintic Newton-Schulz iteration (3.4445, -4.775, 2.0315;
`ns_steps`, in `ns_dtype`: bf16 as torch's always is), weight decay decoupled
(`p *= 1 - lr * wd`), and the lr scaled by the matrix's shape: `match_rms_adamw` 0.2 *
sqrt(max(A, B)) (AdamW's lr carries over), `original` sqrt(max(1, A/B)), `none` 1; Muon's
group has its own peak lr (`optimizer.muon_lr`, default `optimizer.lr`), which the lr
schedule scales like AdamW's. Which parameters take Muon: every parameter with two or more
dims of a block (`layers.*`) or of an MTP module (`mtp.<k>.proj`, `mtp.<k>.block.*`); a
stacked `[E, out, in]` expert tensor is E matrices, each orthogonalized on its own. The
embedding, the output head and every 1-D parameter take AdamW (torch's, with the
`[optimizer]` AdamW keys), in the same optimizer: one state dict, one lr schedule.

Distributed: Newton-Schulz of a shard is not the shard of Newton-Schulz, so each matrix is
orthogonalized whole: where it lives when a rank holds it whole (an expert under EP), else on
one owner of the ranks that shard it, the owners balanced by FLOPs with the load carried over
the buckets (trainer/optim/muon_layout.py), the transfers asynchronous and overlapped with the
next bucket's Newton-Schulz (trainer/optim/muon_dist.py). Parameters and their momentum
buffers are DTensors over FSDP/HSDP, TP and EP meshes, sharded alike; the lr scale uses the
whole matrix's shape. Under PP each stage's ranks own its matrices.

A step skipped on the device (`found_inf`, as the fused AdamW takes it) leaves parameters and
momentum untouched without a host sync: the new values are committed through `torch.where`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.optim.muon_dist import (
    Layout,
    orthogonalize_bucket,
    process_groups,
    receive_results,
    send_pieces,
    spec_of,
)
from trainer.optim.muon_layout import BUCKET_BYTES, MeshPlan, buckets
from trainer.optim.newton_schulz import NS_COEFFICIENTS, NS_EPS, orthogonalize

LR_ADJUST = ("match_rms_adamw", "original", "none")
NS_DTYPES = ("bfloat16", "float32")
__all__ = [
    "BUCKET_BYTES",
    "NS_COEFFICIENTS",
    "NS_EPS",
    "Muon",
    "build_muon",
    "newton_schulz",
    "orthogonalize",
    "takes_muon",
]


def takes_muon(name: str, param) -> bool:
    """A matrix of a block (attention, FFN, router, shared and routed experts) or of an MTP
    module (its projection and its block); `param` a tensor or a shape."""
    ndim = len(param.shape if hasattr(param, "shape") else param)
    inside = ".layers." in f".{name}" or (
        name.startswith("mtp.") and (".block." in name or ".proj." in name)
    )
    return inside and ndim >= 2


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization of one matrix, in `dtype` (the same ops in the same
    order: bitwise equal to torch's in bf16); `orthogonalize` batches it over a stack."""
    return orthogonalize(g, steps, dtype)


def lr_scale(adjust: str, shape) -> float:
    """The shape's lr factor (of each matrix: a stack's last two dims)."""
    rows, cols = shape[-2], shape[-1]
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


class Muon(torch.optim.Optimizer):
    """Param group 0: Muon's matrices (`use_muon`, lr `muon_lr`); the rest: AdamW's groups,
    stepped by a `torch.optim.AdamW` that shares this optimizer's groups and state. `names`:
    the matrices' names (for the layout check's message)."""

    def __init__(
        self,
        muon_params,
        adamw: torch.optim.AdamW | None,
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        lr_adjust: str,
        ns_dtype: str,
        names: list[str] | None = None,
    ):
        muon_params = list(muon_params)
        groups = [{"params": muon_params, "use_muon": True, "lr": lr}]
        for g in adamw.param_groups if adamw else []:  # the same dicts: the lr reaches AdamW
            g["use_muon"] = False
            groups.append(g)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            lr_adjust=lr_adjust,
            ns_dtype=ns_dtype,
            fused=bool(adamw is None or adamw.defaults.get("fused")),
        )
        super().__init__(groups, defaults)
        self._adamw = adamw
        names = names or [f"matrix {i}" for i in range(len(muon_params))]
        self._groups = (
            process_groups(zip(names, muon_params, strict=True)) if dist.is_initialized() else {}
        )
        self._plans: dict = {}  # mesh -> MeshPlan: owners, loads carried across buckets
        self._layouts: dict = {}

    def process_groups(self) -> list:
        """The process groups of Muon's gathers (the traced dry run books their traffic)."""
        return list(self._groups.values())

    def ns_flops(self) -> float:
        """This rank's Newton-Schulz FLOPs per step under the owners assigned so far."""
        return sum(
            plan.load[ranks.index(dist.get_rank()) if len(ranks) > 1 else 0]
            for (ranks, _), plan in self._plans.items()
        )

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
        dtype, steps = getattr(torch, group["ns_dtype"]), group["ns_steps"]

        def momentum(idx: list[int]) -> list[torch.Tensor]:
            """A bucket's updates (its momentum committed): elementwise, on each shard."""
            out = []
            for p in (params[i] for i in idx):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
                new_buf = buf.lerp(grad, 1 - group["momentum"])
                out.append(grad.lerp(new_buf, group["momentum"]) if group["nesterov"] else new_buf)
                _commit(buf, new_buf, found_inf)
            return out

        def apply(idx: list[int], results: dict) -> None:
            lr, decay = group["lr"], group["weight_decay"]
            for m, o in results.items():
                p = params[idx[m]]
                new_p = _local(p).mul(1 - lr * decay)
                new_p.add_(o, alpha=-lr * lr_scale(group["lr_adjust"], p.shape))
                _commit(_local(p), new_p, found_inf)

        work = [(self._layout(params, idx, steps), idx) for idx in self._buckets(params)]
        ups = momentum(work[0][1]) if work else []
        inflight = send_pieces(work[0][0], ups, dtype) if work else []
        waiting = None  # the previous bucket's results on their way back
        for k, (layout, idx) in enumerate(work):  # bucket k + 1 travels while k computes
            following, nxt = [], []
            if k + 1 < len(work):
                nxt = momentum(work[k + 1][1])
                following = send_pieces(work[k + 1][0], nxt, dtype)
            back, local = orthogonalize_bucket(layout, ups, inflight, steps, dtype)
            apply(idx, local)
            if waiting is not None:
                apply(waiting[1], receive_results(*waiting[0]))
            waiting, inflight, ups = ((layout, back), idx), following, nxt
        if waiting is not None:
            apply(waiting[1], receive_results(*waiting[0]))

    def _buckets(self, params: list[torch.Tensor]) -> list[list[int]]:
        """Indices of the parameters in buckets of one mesh (trainer/optim/muon_layout.py)."""
        by_mesh: dict = {}
        for i, p in enumerate(params):
            spec, ranks = spec_of(p)
            by_mesh.setdefault((ranks, spec.sizes), []).append(i)
        return [
            [members[j] for j in b]
            for key, members in by_mesh.items()
            for b in buckets([params[i].numel() for i in members], len(key[0]))
        ]

    def _layout(self, params, idx: list[int], steps: int) -> Layout:
        """The bucket's layout: its owners from its mesh's plan, loads carried over."""
        key = tuple(id(params[i]) for i in idx)
        if key not in self._layouts:
            specs, ranks = zip(*(spec_of(params[i]) for i in idx), strict=True)
            mesh = (ranks[0], specs[0].sizes)
            if mesh not in self._plans:
                self._plans[mesh] = MeshPlan(specs[0].sizes, steps)
            me = ranks[0].index(dist.get_rank()) if len(ranks[0]) > 1 else 0
            assigned = self._plans[mesh].assign(list(specs), me)
            self._layouts[key] = Layout([params[i] for i in idx], assigned, ranks[0], self._groups)
        return self._layouts[key]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _commit(target: torch.Tensor, new: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """target = new, or unchanged where the device says the step is skipped (no host sync)."""
    if found_inf is None:
        target.copy_(new)
    else:
        target.copy_(torch.where(found_inf.to(torch.bool), target, new))


def muon_peak_lr(cfg) -> float:
    """The matrices' peak lr under the `[optimizer]` config: muon_lr, or lr at -1."""
    return cfg.muon_lr if cfg.muon_lr > 0 else cfg.lr


def build_muon(model: torch.nn.Module, cfg, adamw_cls, **adamw_kwargs) -> Muon:
    """Muon over the blocks' matrices, `adamw_cls(**adamw_kwargs)` over the rest."""
    muon, names, rest = [], [], []
    for name, p in model.named_parameters():
        if takes_muon(name, p):
            muon.append(p)
            names.append(name)
        else:
            rest.append(p)
    adamw = adamw_cls(rest, **adamw_kwargs) if rest else None  # a stage of blocks only
    lr = muon_peak_lr(cfg)
    return Muon(
        muon,
        adamw,
        lr=lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        lr_adjust=cfg.muon_lr_adjust,
        ns_dtype=cfg.muon_ns_dtype,
        names=names,
    )
