"""Guards on the loss: skip steps whose loss or gradient norm is not finite, stop after too
many in a row, and count loss spikes.

Skipping is decided without an extra collective: a rank whose own loss is not finite turns one
element of its local gradient shard into NaN (`flag_nonfinite_loss`), so the global gradient
norm, which clipping all-reduces anyway and every rank receives identically, is not finite on
every rank. Every rank then skips the optimizer step together: parameters and optimizer state
stay untouched. The lr scheduler still advances (the lr stays a function of the step number,
as the logged lr and a resume expect), and the step's data is consumed (the bad batch is not
retried).

After `training.max_skipped_steps` consecutive skips, the next non-finite step stops the run
with a `training error:` line and exit code 4 (TrainingError); no checkpoint is written at a
skipped step.

Spikes: a finite loss more than `spike_threshold` standard deviations above the mean of the
previous `spike_window` losses is a spike; it is printed and counted (`loss_metrics/spikes`).
"""

from __future__ import annotations

import math
import os
from collections import deque

import torch

from trainer.errors import TrainingError

# Testing hook: "RANK:STEP,STEP,..." makes that rank's loss NaN at those steps (after backward,
# so only the guard sees it), e.g. TRAINER_TEST_NAN_LOSS=1:3,4.
NAN_ENV = "TRAINER_TEST_NAN_LOSS"


def injected_nan(step: int) -> float:
    spec = os.environ.get(NAN_ENV)
    if spec:
        rank, _, steps = spec.partition(":")
        if rank == os.environ.get("RANK", "0") and str(step) in steps.split(","):
            return math.nan
    return 0.0


def flag_nonfinite_loss(model: torch.nn.Module, loss: torch.Tensor) -> None:
    """Add 0 * loss to one local gradient element: +0 when the loss is finite, NaN when not.
    No host sync; the NaN reaches every rank through the gradient norm's all-reduce."""
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.numel():
            local.view(-1)[:1].add_(loss.detach().to(local.device, local.dtype) * 0)  # offload: CPU
            return


class LossGuard:
    def __init__(self, training_cfg, *, log, metrics):
        self.max_skipped = training_cfg.max_skipped_steps
        self.threshold = training_cfg.spike_threshold
        self.window: deque[float] = deque(maxlen=training_cfg.spike_window)
        self.log, self.metrics = log, metrics
        self.streak: list[int] = []  # consecutive skipped steps
        self.nonfinite_loss = False  # any step of the streak had a non-finite loss
        self.skipped = self.spikes = 0

    def skipped_step(self, step: int, avg_loss: float, grad_norm: float,
                     last_checkpoint: str) -> None:
        """Record a skipped step; raise TrainingError once the streak exceeds the limit."""
        self.streak.append(step)
        self.skipped += 1
        self.nonfinite_loss |= not math.isfinite(avg_loss)
        self.metrics.log_scalars(step, {"loss_metrics/skipped_steps": self.skipped})
        self.log(f"step {step}: skipped the optimizer step (loss {avg_loss}, grad_norm "
                 f"{grad_norm}); {len(self.streak)} in a row, at most "
                 f"{self.max_skipped} allowed (training.max_skipped_steps); no checkpoint is saved "
                 "at a skipped step")
        if len(self.streak) > self.max_skipped:
            what = "loss" if self.nonfinite_loss else "grad norm"
            first, last = self.streak[0], self.streak[-1]
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            raise TrainingError(f"non-finite {what} at {steps}; last checkpoint "
                                f"{last_checkpoint}")

    def good_step(self, step: int, loss: float) -> None:
        """A step that updated the weights: end any streak, look for a spike."""
        self.streak, self.nonfinite_loss = [], False
        if not self.window.maxlen:
            return
        full = len(self.window) == self.window.maxlen
        if full and math.isfinite(loss):
            mean = sum(self.window) / len(self.window)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / len(self.window))
            if loss > mean + self.threshold * std:
                self.spikes += 1
                self.metrics.log_scalars(step, {"loss_metrics/spikes": self.spikes})
                self.log(f"loss spike at step {step}: {loss:.4f} > mean {mean:.4f} + "
                         f"{self.threshold:g} x std {std:.4f} of the previous "
                         f"{len(self.window)} steps ({self.spikes} so far)")
        if math.isfinite(loss):
            self.window.append(loss)
