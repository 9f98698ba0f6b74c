"""The duties around a step's optimizer step, as one ordered list of hooks (`TrainStep.hooks`,
trainer/step.py): the same hooks run in the same order on every rank, so the collectives some
of them make (the experts' loads, QK-clip's maxima) match.

A hook may act before the step's microbatches (`before`: the MTP loss weight of the step),
keep the optimizer from stepping (`veto`: a loss spike), and act after the optimizer step
(`after`: the experts' balancing bias, QK-clip), returning what it measured, to log.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepHook:
    """One duty of the step; the defaults do nothing."""

    #: Whether `veto` may skip a step. A vetoing hook reads the loss on the host before the
    #: optimizer step (one more sync); without one the skip is decided on the device.
    vetoes = False

    def before(self, step: int, model: torch.nn.Module) -> None:
        """Before the step's microbatches run."""

    def veto(self, cross_entropy: torch.Tensor):
        """Why this step must not take its optimizer step (a trainer.health.guard.Spike), or
        None; asked only when the gradient norm is finite."""
        return None

    def after(self, step: int, model: torch.nn.Module, stepped) -> dict:
        """After the optimizer step (`stepped`: a bool, or the device's one-element flag while
        only the device knows): what to log, as scalars or 0-d device tensors."""
        return {}


class SpikeVeto(StepHook):
    """training.on_spike != "log": the loss guard's spike check skips the optimizer step
    (trainer/health/spikes.py builds `check`)."""

    vetoes = True

    def __init__(self, check: Callable):
        self.check = check

    def veto(self, cross_entropy: torch.Tensor):
        return self.check(cross_entropy)


class MTPWeight(StepHook):
    """The MTP loss weight as a function of the step (model.mtp_loss_weight_until_step), set
    on the model before the step's forwards and logged."""

    def __init__(self, weight_at: Callable[[int], float]):
        self.weight_at = weight_at

    def before(self, step: int, model: torch.nn.Module) -> None:
        model.mtp_loss_weight = self.weight_at(step)

    def after(self, step: int, model: torch.nn.Module, stepped) -> dict:
        return {"loss_metrics/mtp_loss_weight": self.weight_at(step)}


class ExpertBalance(StepHook):
    """The experts' loads summed over the world and the balancing bias moved if the optimizer
    stepped (trainer/models/common/moe.py's balance_experts), at `coeff`, or at `coeff_at(step)`
    when the bias update speed is scheduled (moe.load_balance_coeff_until_step); a dense model's
    loads are empty and nothing is reduced."""

    def __init__(self, *, n_layers: int, coeff: float, device, moe_ids, coeff_at=None):
        self.kwargs = dict(n_layers=n_layers, coeff=coeff, device=device, moe_ids=moe_ids)
        self.coeff_at = coeff_at

    def after(self, step: int, model: torch.nn.Module, stepped) -> dict:
        from trainer.models.common.moe import balance_experts

        kwargs = self.kwargs
        if self.coeff_at is not None:
            kwargs = {**kwargs, "coeff": self.coeff_at(step)}
        out = balance_experts(model, stepped=stepped, **kwargs)
        if self.coeff_at is not None:
            out = {**out, "moe/load_balance_coeff": kwargs["coeff"]}
        return out
