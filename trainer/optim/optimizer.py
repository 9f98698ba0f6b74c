"""Optimizer and learning-rate scheduler.

The lr of every step is `optimizer.lr * factor(step)`, with the factor's formula (warmup,
stable phase, decay over the last `decay_steps`) in trainer/optim/lr_schedule.py. The scheduler's
checkpoint holds only its position: a resume follows the formula of its own config from the
resumed step on (see LRSchedule).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from trainer.optim.lr_schedule import decay_steps, lr_factor
from trainer.optim.muon import build_muon, muon_peak_lr


def implementation(name: str) -> str:
    """`auto`: the fused kernel (one launch for all tensors; foreach costs ~12% of a 1B step
    on an H100, and is ~3x slower on a CPU), which can skip a step without a host sync
    (`step_unless`). Explicit names are kept."""
    return "fused" if name == "auto" else name


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step_unless` can skip this optimizer's step on the device: only the fused
    kernels take GradScaler's `found_inf`."""
    return bool(optimizer.defaults.get("fused"))


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`optimizer.step()`, which leaves the parameters, the moments and the step count as they
    were where the one-element `skip` is true, decided on the device: the host never waits for
    it (the fused kernels' `found_inf`, the mechanism GradScaler uses)."""
    # the first parameter of any group (Muon's matrices may be none on a pipeline rank)
    param = next(p for group in optimizer.param_groups for p in group["params"])
    device = param.device if not hasattr(param, "to_local") else param.to_local().device
    optimizer.found_inf = skip.to(device=device, dtype=torch.float32).reshape(())
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


class _OnLocalShards:
    """torch's Adam/AdamW whose update runs on each DTensor's local shard: the parameters, the
    gradients and the moments stay DTensors (the checkpoint, the memory and the layout are
    torch's), and the update, elementwise, is the same to the bit. DTensor's own dispatch of the
    fused/foreach kernels over a list of N DTensors propagates shardings at ~N^2 cost the first
    time (160 tensors: 0.5 s fused, 2 s foreach on a CPU host; a third of a Kimi K2 trace) and
    ~2x the host time of every step after it (benchmarks/optim/bench_adam_local.py). A group whose
    gradients are not laid out as their parameters (which DTensor would redistribute) is left to
    DTensor."""

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        params, grads = lists[0], lists[1]
        if all(
            not isinstance(p, DTensor)
            or (
                isinstance(g, DTensor)
                and g.placements == p.placements
                and g.device_mesh == p.device_mesh
            )
            for p, g in zip(params, grads, strict=True)
        ):
            for tensors in lists:
                if isinstance(tensors, list):
                    tensors[:] = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return has_complex


class AdamW(_OnLocalShards, torch.optim.AdamW):
    """torch.optim.AdamW stepping the local shards (_OnLocalShards)."""


class Adam(_OnLocalShards, torch.optim.Adam):
    """torch.optim.Adam stepping the local shards (_OnLocalShards)."""


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW/Adam over the (sharded) parameters, or Muon for the blocks' matrices with AdamW
    for the rest (trainer/optim/muon.py), from the `[optimizer]` section."""
    impl = implementation(cfg.implementation)
    kwargs = dict(
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=impl == "foreach",
        fused=impl == "fused",
    )
    if cfg.name == "Muon":
        return build_muon(model, cfg, AdamW, **kwargs)
    cls = AdamW if cfg.name == "AdamW" else Adam
    return cls(model.parameters(), **kwargs)


class LRSchedule(LambdaLR):
    """A LambdaLR whose checkpoint restores only its position (the step): the factor formula and
    the peak lr stay this run's config, and the optimizer's lr is set from them on load. Load
    it after the optimizer, whose param groups are this run's again after a load (every other
    setting too: trainer/checkpoint/optim_state.py) but at the first step's lr."""

    #: After a load: (the resumed step, the lr the checkpoint's run would have used there and
    #: the lr this run uses, by kind of group: 'lr' (optimizer.lr's), 'muon' (Muon's matrices))
    resumed: tuple[int, dict[str, float], dict[str, float]] | None = None
    #: This run's peak lr by kind (build_lr_scheduler): saved in place of the rank's own groups
    peaks: dict[str, float] | None = None

    def state_dict(self) -> dict:
        """LambdaLR's state without `resumed` (this process's, not the run's). With `peaks`, its
        base_lrs and _last_lr are per kind, Muon's first, the same on every rank: DCP saves
        one rank's copy, not always rank 0's, and a pipeline stage of blocks has no
        optimizer.lr group of its own."""
        out = {k: v for k, v in super().state_dict().items() if k not in ("resumed", "peaks")}
        if self.peaks:
            base = [self.peaks[k] for k in ("muon", "lr") if k in self.peaks]
            out["base_lrs"], out["_last_lr"] = base, [b * self._factor() for b in base]
            out["lr_lambdas"] = [None] * len(base)  # LambdaLR's per group (a function: None)
        return out

    def _factor(self) -> float:
        """The schedule's factor at the next step (every group's lr is its peak x this)."""
        return self._last_lr[0] / self.base_lrs[0] if self.base_lrs[0] else 0.0

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict["_step_count"])
        self._last_lr = [
            base * fn(self.last_epoch)
            for base, fn in zip(self.base_lrs, self.lr_lambdas, strict=True)
        ]
        for group, base, lr in zip(
            self.optimizer.param_groups, self.base_lrs, self._last_lr, strict=True
        ):
            group["initial_lr"], group["lr"] = base, lr
        saved = [float(x) for x in state_dict.get("_last_lr") or self._last_lr]
        # Muon's lr first in a Muon run's list, optimizer.lr's last in any run's (an older
        # checkpoint's list is the saving rank's groups: the same order)
        was = {"muon": saved[0], "lr": saved[-1]}
        now = self._by_kind()
        self.resumed = (self.last_epoch + 1, {k: was[k] for k in now}, now)

    def _by_kind(self) -> dict[str, float]:
        """This run's lr at the next step by kind of group, optimizer.lr's first."""
        if self.peaks:
            return {k: self.peaks[k] * self._factor() for k in ("lr", "muon") if k in self.peaks}
        out: dict[str, float] = {}
        for group in self.optimizer.param_groups:
            out.setdefault("muon" if group.get("use_muon") else "lr", float(group["lr"]))
        return dict(sorted(out.items(), key=lambda kv: kv[0] != "lr"))

    def resume_note(self) -> str | None:
        """One line when the resumed step's lr differs from the checkpoint's next lr, for
        optimizer.lr's groups or (Muon) the matrices' optimizer.muon_lr group."""
        if self.resumed is None:
            return None
        step, was, now = self.resumed
        changed = [k for k in now if not math.isclose(was[k], now[k], rel_tol=1e-9)]
        if not changed:
            return None
        what = " and ".join(
            f"lr {now[k]:.6g}"
            if k == "lr"
            else f"Muon's matrices (optimizer.muon_lr) at lr {now[k]:.6g}"
            for k in changed
        )
        keys = "optimizer.lr, muon_lr" if "muon" in now else "optimizer.lr"
        return (
            f"lr schedule changed at the resume: step {step} trains at {what} (this run's "
            f"{keys}, [lr_scheduler] and training.steps); the checkpoint's run would have "
            f"used {' and '.join(f'{was[k]:.6g}' for k in changed)}"
        )


def lr_peaks(cfg) -> dict[str, float]:
    """The peak lr of each kind of param group under the `[optimizer]` config `cfg`:
    optimizer.lr's ('lr') and, under Muon, the matrices' ('muon': muon_lr, or lr at -1)."""
    if cfg.name != "Muon":
        return {"lr": cfg.lr}
    return {"lr": cfg.lr, "muon": muon_peak_lr(cfg)}


def group_lrs(optimizer: torch.optim.Optimizer) -> tuple[float, float | None]:
    """(the lr of optimizer.lr's groups, Muon's matrices' lr or None without Muon) of the
    step about to be taken. A pipeline stage of blocks alone under Muon has no optimizer.lr
    group: its first lr stands in (rank 0, which logs, holds the embedding)."""
    muon = next((g["lr"] for g in optimizer.param_groups if g.get("use_muon")), None)
    rest = next(
        (g["lr"] for g in optimizer.param_groups if not g.get("use_muon")),
        optimizer.param_groups[0]["lr"],
    )
    return float(rest), None if muon is None else float(muon)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg, total_steps: int, peaks: dict[str, float] | None = None
) -> LRSchedule:
    """The lr schedule of trainer/optim/lr_schedule.py (`cfg` is `[lr_scheduler]`; `peaks`:
    lr_peaks of the run's `[optimizer]`, what its checkpoints and resume line name)."""
    k = decay_steps(cfg, total_steps)

    def fn(done: int) -> float:  # LambdaLR passes the steps done; it sets the lr of the next
        return lr_factor(
            done + 1,
            warmup_steps=cfg.warmup_steps,
            decay_steps=k,
            total_steps=total_steps,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
        )

    schedule = LRSchedule(optimizer, fn)
    schedule.peaks = peaks
    return schedule
