"""One optimizer step, the same for every layout.

Fetch the step's microbatches, count the tokens every rank will train on (the loss is a mean
over the global token count), run forward and backward through the parallelism's seam
(trainer/parallel/microbatches.py), then clip over every mesh, guard against non-finite losses
and spikes, and step the optimizer and the scheduler.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from trainer.data import count_targets
from trainer.distributed import DEBUG_DATA_ENV, print_sample_hashes, to_device
from trainer.health import faults, heartbeat
from trainer.health.guard import Spike, flag_nonfinite_loss
from trainer.optim.optimizer import group_lrs, skips_on_device, step_unless
from trainer.parallel.clip import clip_grad_norm_
from trainer.parallel.microbatches import ForwardBackward


class StepResult(NamedTuple):
    rank_loss: torch.Tensor  # this rank's mean cross-entropy
    grad_norm: torch.Tensor
    lr: float
    # False, on every rank alike, when the optimizer step was skipped; a one-element tensor
    # while only the device knows (TrainStep.optimizer_step): the loop resolves it
    stepped: bool | torch.Tensor
    z_loss: torch.Tensor | None
    spike: Spike | None = None  # what `spike_check` found before the optimizer step
    # this rank's summed cross-entropy / the global token count: summed over the dp ranks, the
    # token-weighted global mean (the logged loss), whatever each rank's token count
    loss_share: torch.Tensor | None = None
    scalars: dict | None = None  # e.g. the experts' load imbalance (trainer/models/moe.py)
    # this rank's MTP loss share (mean over depths, / the global token count), or None
    mtp_loss: torch.Tensor | None = None


@dataclass
class TrainStep:
    """`train_step(step, accum)`: one optimizer step over `accum` microbatches.

    `stepped` is False, on every rank alike, when the loss of any rank or the grad norm was not
    finite, or when `spike_check(rank_loss)` (training.on_spike != "log": called before the
    optimizer step when the grad norm is finite) found a spike: the optimizer step is then
    skipped (trainer/health/guard.py). The z-loss is None without one, else this rank's z-loss
    term / the global token count (summed over the dp ranks: the global mean per token).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    loader: object
    forward_backward: ForwardBackward
    metrics: object  # data_timer() and count_tokens(n): trainer.observe.metrics
    dp_group: object
    device: torch.device
    max_norm: float = 0.0  # 0: no clipping (the norm is still computed)
    spike_check: Callable | None = None
    # after the optimizer step: the experts' balancing bias (moved only if the optimizer
    # stepped) and load metrics ({} if dense)
    balance: Callable | None = None
    pp: int = 1  # pipeline stages (the gradient norm counts each stage's ranks)
    # called when this rank's own work of the step is done, before the collectives after the
    # optimizer step (the straggler watch's stop: trainer/health/stragglers.py)
    work_done: Callable | None = None
    # The recipe's schedules, functions of the step (None: the config's constant): the MTP
    # loss weight of the step, and the bias update speed after it (trainer/models/config.py)
    mtp_loss_weight: Callable[[int], float] | None = None
    balance_coeff: Callable[[int], float] | None = None
    # after the optimizer step: QK-clip of the heads whose logits passed the threshold, and
    # its metrics (trainer/optim/qk_clip.py; None when optimizer.muon_qk_clip = 0)
    qk_clip: Callable | None = None

    def __call__(self, step: int, accum: int) -> StepResult:
        heartbeat.phase("step_start", step)
        faults.armed().step_start(step, self.loader)  # a testing hook; nothing unless asked
        batches = self.fetch(accum)
        if self.mtp_loss_weight is not None:  # the weight the model's MTP loss uses
            self.model.mtp_loss_weight = self.mtp_loss_weight(step)
        local_tokens = sum(count_targets(labels) for _, labels in batches)  # host tensors
        global_tokens = to_device(torch.tensor(float(local_tokens)), self.device)
        dist.all_reduce(global_tokens, group=self.dp_group)
        loss_sum, z_loss, aux, mtp = self.forward_backward(batches, global_tokens, step)
        if z_loss is not None:
            z_loss = z_loss / global_tokens
        loss_sum = faults.armed().loss(step, loss_sum)  # a spike or NaN, if asked
        flag_nonfinite_loss(self.model, loss_sum)  # a rank's bad loss makes the global norm NaN
        heartbeat.phase("clip")
        grad_norm = clip_grad_norm_(self.model.parameters(), self.max_norm or math.inf, self.pp)
        lr, lr_muon = group_lrs(self.optimizer)  # this step's (the scheduler steps after it)
        cross_entropy = loss_sum if z_loss is None else loss_sum - z_loss
        mtp_loss = None
        if mtp is not None:  # the MTP heads' mean loss per token (trainer/models/mtp.py)
            mtp_loss = mtp / self.model.args.mtp_layers
            cross_entropy = cross_entropy - self.model.mtp_loss_weight * mtp_loss
        rank_loss = cross_entropy * global_tokens / max(local_tokens, 1)
        heartbeat.phase("optimizer")
        stepped, spike = self.optimizer_step(grad_norm, cross_entropy)
        faults.armed().step_end()  # a testing hook: a slow rank
        if self.work_done is not None:
            self.work_done()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.metrics.count_tokens(local_tokens)
        scalars = (
            self.balance(self.model, stepped=stepped, **self.balance_kwargs(step))
            if self.balance
            else None
        )
        if aux is not None:
            scalars = {**(scalars or {}), "moe/aux_loss": aux}
        if self.qk_clip is not None:
            scalars = {**(scalars or {}), **self.qk_clip(stepped)}
        if lr_muon is not None:  # Muon's matrices' lr (optimizer.muon_lr x the same factor)
            scalars = {**(scalars or {}), "lr_muon": lr_muon}
        if self.scheduled(step):
            scalars = {**(scalars or {}), **self.scheduled(step)}
        return StepResult(
            rank_loss, grad_norm, lr, stepped, z_loss, spike, cross_entropy, scalars, mtp_loss
        )

    def balance_kwargs(self, step: int) -> dict:
        return {} if self.balance_coeff is None else {"coeff": self.balance_coeff(step)}

    def scheduled(self, step: int) -> dict[str, float]:
        """The scheduled values of the step, to log (none without a schedule)."""
        out = {}
        if self.mtp_loss_weight is not None:
            out["loss_metrics/mtp_loss_weight"] = self.mtp_loss_weight(step)
        if self.balance_coeff is not None:
            out["moe/load_balance_coeff"] = self.balance_coeff(step)
        return out

    def optimizer_step(
        self, grad_norm: torch.Tensor, cross_entropy: torch.Tensor
    ) -> tuple[bool | torch.Tensor, Spike | None]:
        """The optimizer step unless the grad norm (a reduced value: the same on every rank)
        is not finite or the spike check finds a spike. With the fused optimizer and no spike
        check (the defaults) the skip is decided on the device and `stepped` is a tensor the
        loop reads at its step-end agreement, the step's one host sync; otherwise the host
        reads the norm here (one more sync)."""
        finite = torch.isfinite(grad_norm)
        if self.spike_check is None and skips_on_device(self.optimizer):
            step_unless(self.optimizer, ~finite)
            return finite, None
        stepped = bool(finite)
        spike = self.spike_check(cross_entropy) if stepped and self.spike_check else None
        if stepped and spike is None:
            self.optimizer.step()
        return stepped and spike is None, spike

    def fetch(self, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's microbatches; with TRAINER_DEBUG_DATA_HASHES, where each sample comes
        from is printed (if the order is global)."""
        debug_ids = None
        if os.environ.get(DEBUG_DATA_ENV):
            debug_ids = (
                self.loader.sample_ids(self.loader.sample_indices(0))
                if hasattr(self.loader, "sample_indices")
                else []
            )
        with self.metrics.data_timer():
            batches = [self.loader.next_microbatch() for _ in range(accum)]
        if debug_ids is not None:
            print_sample_hashes(batches, self.dp_group, debug_ids)
        return batches
