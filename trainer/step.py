"""One optimizer step, the same for every layout.

Fetch the step's microbatches, count the tokens every rank will train on (the loss is a mean
over the global token count), run forward and backward through the parallelism's seam
(trainer/parallel/microbatches.py), then clip over every mesh, guard against non-finite losses
and spikes, and step the optimizer and the scheduler.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, ContextManager, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from trainer.data import count_targets
from trainer.distributed import DEBUG_DATA_ENV, print_sample_hashes, to_device
from trainer.health import faults, heartbeat
from trainer.health.guard import Spike, flag_nonfinite_loss
from trainer.optim.optimizer import group_lrs, skips_on_device, step_unless
from trainer.optim.step_hooks import StepHook
from trainer.parallel.clip import clip_grad_norm_
from trainer.parallel.microbatches import ForwardBackward


class Loader(Protocol):
    """What the step asks of a data loader (trainer/data/: every loader)."""

    def next_microbatch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, labels) [local batch, seq_len]."""
        ...


@runtime_checkable
class GlobalOrder(Protocol):
    """A loader whose samples have a global order (not a stream): where each comes from."""

    def sample_indices(self, step: int) -> list[int]: ...

    def sample_ids(self, indices) -> list: ...


class StepMetrics(Protocol):
    """What the step tells the metrics (trainer/observe/metrics.py's MetricsProcessor)."""

    def data_timer(self) -> ContextManager: ...

    def count_tokens(self, n: int) -> None: ...


class Scheduler(Protocol):
    """The lr scheduler (trainer/optim/optimizer.py's LRSchedule)."""

    def step(self) -> None: ...


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
    scalars: dict | None = None  # e.g. the experts' load imbalance (trainer/models/common/moe.py)
    # this rank's MTP loss share (mean over depths, / the global token count), or None
    mtp_loss: torch.Tensor | None = None


@dataclass
class TrainStep:
    """`train_step(step, accum)`: one optimizer step over `accum` microbatches.

    `stepped` is False, on every rank alike, when the loss of any rank or the grad norm was not
    finite, or when a hook vetoes it (the spike check, training.on_spike != "log": asked
    before the optimizer step when the grad norm is finite): the optimizer step is then
    skipped (trainer/health/guard.py). The z-loss is None without one, else this rank's z-loss
    term / the global token count (summed over the dp ranks: the global mean per token).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler
    loader: Loader
    forward_backward: ForwardBackward
    metrics: StepMetrics
    dp_group: dist.ProcessGroup
    device: torch.device
    max_norm: float = 0.0  # 0: no clipping (the norm is still computed)
    pp: int = 1  # pipeline stages (the gradient norm counts each stage's ranks)
    # The duties around the optimizer step, in order (trainer/optim/step_hooks.py): the spike
    # check's veto, the MTP loss weight, the experts' balancing bias, QK-clip
    hooks: list[StepHook] = field(default_factory=list)
    # called when this rank's own work of the step is done, before the collectives after the
    # optimizer step (the straggler watch's stop: trainer/health/stragglers.py)
    work_done: Callable | None = None

    def __call__(self, step: int, accum: int) -> StepResult:
        heartbeat.phase("step_start", step)
        faults.armed().step_start(step, self.loader)  # a testing hook; nothing unless asked
        batches = self.fetch(accum)
        for hook in self.hooks:
            hook.before(step, self.model)
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
        if mtp is not None:  # the MTP heads' mean loss per token (trainer/models/common/mtp.py)
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
        scalars = {}
        for hook in self.hooks:
            scalars.update(hook.after(step, self.model, stepped))
        if aux is not None:
            scalars["moe/aux_loss"] = aux
        if lr_muon is not None:  # Muon's matrices' lr (optimizer.muon_lr x the same factor)
            scalars["lr_muon"] = lr_muon
        return StepResult(
            rank_loss,
            grad_norm,
            lr,
            stepped,
            z_loss,
            spike,
            cross_entropy,
            scalars or None,
            mtp_loss,
        )

    def optimizer_step(
        self, grad_norm: torch.Tensor, cross_entropy: torch.Tensor
    ) -> tuple[bool | torch.Tensor, Spike | None]:
        """The optimizer step unless the grad norm (a reduced value: the same on every rank)
        is not finite or the spike check finds a spike. With the fused optimizer and no spike
        check (the defaults) the skip is decided on the device and `stepped` is a tensor the
        loop reads at its step-end agreement, the step's one host sync; otherwise the host
        reads the norm here (one more sync)."""
        finite = torch.isfinite(grad_norm)
        vetoes = [hook for hook in self.hooks if hook.vetoes]
        if not vetoes and skips_on_device(self.optimizer):
            step_unless(self.optimizer, ~finite)
            return finite, None
        stepped, spike = bool(finite), None
        for hook in vetoes if stepped else ():
            spike = spike or hook.veto(cross_entropy)
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
                if isinstance(self.loader, GlobalOrder)
                else []
            )
        with self.metrics.data_timer():
            batches = [self.loader.next_microbatch() for _ in range(accum)]
        if debug_ids is not None:
            print_sample_hashes(batches, self.dp_group, debug_ids)
        return batches
