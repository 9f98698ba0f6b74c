"""QK-clip (MuonClip, Kimi K2; `optimizer.muon_qk_clip`): after each optimizer step, every
attention head whose largest pre-softmax logit in the step exceeded the threshold tau has its
query and key weights scaled so that the same inputs would give a largest logit of tau.

Per head h with largest logit m_h > tau, gamma_h = tau / m_h, and each attention layer scales
its own weights (its `clip_logits_(gamma)`; `query_weight()` names its query rows), as Kimi K2,
section 2.1 says for each kind:
- multi-head latent attention: the head's query rows and its own key rows (`wkv_b`'s key
  part, the non-shared one) each x sqrt(gamma_h), the head's rotary query rows x gamma_h; the
  rotary key, which every head shares, and the values are untouched;
- standard attention with one key head per query head: the head's query and key rows each
  x sqrt(gamma_h);
- grouped-query attention (a key head serves several query heads): the query rows x gamma_h
  and the shared key head untouched, so no other head's logits change;
- attention with a per-head RMSNorm of q and k (Qwen3, Qwen3-Next): the norms divide out any
  scale of the query and key rows, so the clip scales the norms' weights instead, the only
  place a scale survives. Those weights are shared by every head of the layer, so the layer
  clips as one: each norm's output x sqrt(gamma) with gamma = tau / (the layer's largest
  logit), every head of the layer scaled alike (a per-head clip cannot be expressed there).
Heads at or under tau keep their weights (on a q/k-normed layer: when all of them are). A
skipped step (non-finite loss, a spike) skips the clip too, and a non-finite maximum never
scales anything. Evaluation forwards (the model in eval mode) record nothing.

The maxima come from the forward passes of the step (trainer/models/common/logits.py), every
microbatch's: each attention layer raises a [local heads] buffer on the device. After the
step one all-reduce (MAX) over the whole world of a [layers, heads] table (MTP modules'
attention after the main layers) combines the data-parallel, context-parallel and
pipeline-parallel ranks, and the tensor-parallel ranks' head shards (each tp rank writes its
own heads): one collective of 4 x layers x heads bytes, and no host sync.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from trainer.optim.step_hooks import StepHook


def _layer_index(name: str, n_layers: int) -> int | None:
    """The table row of an attention module named `name` (a stage's or the whole model's)."""
    if m := re.search(r"(?:^|\.)layers\.(\d+)\.attention$", name):
        return int(m.group(1))
    if m := re.search(r"(?:^|\.)mtp\.(\d+)\.block\.attention$", name):
        return n_layers + int(m.group(1))
    return None


def _tp_rank(param) -> int:
    mesh = getattr(param, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh.get_local_rank("tp") if "tp" in names else 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class QKClip(StepHook):
    """The attention modules of `model` (one stage's under PP) armed to record their maxima,
    and the clip applied after each step (a step hook: trainer/optim/step_hooks.py)."""

    def __init__(self, model: torch.nn.Module, args, threshold: float):
        self.threshold, self.heads = float(threshold), args.n_heads
        self.rows = args.n_layers + args.mtp_layers
        self.layers = []  # (row, module, first global head)
        for name, module in model.named_modules():
            row = _layer_index(name, args.n_layers)
            if row is None:
                continue
            q = module.query_weight()
            local = args.n_heads // _tp_size(q)  # tp shards whole heads, evenly
            module.logit_max = torch.full((local,), float("-inf"), device=_local(q).device)
            self.layers.append((row, module, _tp_rank(q) * local))
        self.device = self.layers[0][1].logit_max.device if self.layers else torch.device("cpu")

    def maxima(self) -> torch.Tensor:
        """[layers, heads] fp32: every head's largest logit since the last call, over the
        world (-inf where no forward ran); the buffers reset."""
        table = torch.full((self.rows, self.heads), float("-inf"), device=self.device)
        for row, module, first in self.layers:
            buf = module.logit_max
            table[row, first : first + buf.numel()] = buf
            buf.fill_(float("-inf"))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        return table

    def after(self, step: int, model, stepped) -> dict[str, torch.Tensor]:
        return self(stepped)

    def __call__(self, stepped) -> dict[str, torch.Tensor]:
        """After an optimizer step that `stepped` (a bool, or the device's one-element flag
        while only the device knows)."""
        if isinstance(stepped, torch.Tensor):
            return self.step(skip=~stepped.to(torch.bool))
        return self.step(skip=None if stepped else torch.ones((), dtype=torch.bool))

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Clip after an optimizer step (`skip`: the device flag of a skipped step). Returns
        device scalars to log: the largest logit and the number of heads clipped."""
        table = self.maxima()
        clip = torch.isfinite(table) & (table > self.threshold)
        if skip is not None:
            clip &= ~skip.to(device=table.device, dtype=torch.bool).reshape(())
        gamma = torch.where(clip, self.threshold / table.clamp(min=self.threshold), 1.0)
        for row, module, _ in self.layers:
            module.clip_logits_(gamma[row])  # every head: the weights' global rows
        seen = torch.where(torch.isfinite(table), table, torch.zeros_like(table))
        return {"qk_clip/max_logit": seen.max(), "qk_clip/heads_clipped": clip.sum().float()}


def _tp_size(p) -> int:
    mesh = getattr(p, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh.size(names.index("tp")) if "tp" in names else 1


def build_qk_clip(model: torch.nn.Module, cfg, log=print) -> QKClip | None:
    """The clip of `[optimizer] muon_qk_clip` (None when 0), said in one startup line."""
    if not cfg.muon_qk_clip:
        return None
    clip = QKClip(model, model.args, cfg.muon_qk_clip)
    normed = any(getattr(m, "q_norm", None) is not None for _, m, _ in clip.layers)
    where = (
        "the q/k norm weights of every attention layer (each layer as one: its norms undo a "
        "scale of the query/key rows)"
        if normed
        else "the query/key weights of every attention head"
    )
    log(
        f"QK-clip: after each step, {where} whose largest logit passed "
        f"{cfg.muon_qk_clip:g} are scaled back to it (qk_clip/*)"
    )
    return clip
