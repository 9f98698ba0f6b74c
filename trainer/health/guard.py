"""Guards on the loss: skip steps whose loss or gradient norm is not finite, stop after too
many in a row, and find loss spikes, then log them, skip them or roll back (`on_spike`).

Skipping is decided without an extra collective: a rank whose own loss is not finite turns one
element of its local gradient shard into NaN (`flag_nonfinite_loss`), so the global gradient
norm, which clipping all-reduces anyway and every rank receives identically, is not finite on
every rank. Every rank then skips the optimizer step together: parameters and optimizer state
stay untouched. The lr scheduler still advances (the lr stays a function of the step number,
as the logged lr and a resume expect), and the step's data is consumed (the bad batch is not
retried).

After `training.max_skipped_steps` consecutive skips, the next skip stops the run with a
`training error:` line and exit code 4 (TrainingError); no checkpoint is written at a skipped
step.

Spikes: a finite loss (the mean over the ranks) more than `spike_threshold` standard
deviations above the mean of the previous `spike_window` losses is a spike. The window holds
only losses of steps that updated the weights, and it is part of the checkpointed TrainState,
so a resume or a rollback detects with the history the checkpoint had. `training.on_spike`:

- "log": print and count it (`loss_metrics/spikes`), after the optimizer step, with the loss
  that the step-end all-reduce brings anyway (no extra collective).
- "skip": decided before the optimizer step, which needs the global loss earlier: one extra
  one-element all-reduce per step. The step is skipped like a non-finite one, and it extends
  the same streak that `max_skipped_steps` bounds: a lasting rise of the loss (never added to
  the window, so every later step would be a spike) stops the run instead of skipping forever.
- "rollback": decided the same way; every rank reloads the newest checkpoint of this run and
  the spiking step passes over one global batch when training reaches it again
  (trainer/health/spikes.py `roll_back`). The rollbacks are recorded in the TrainState; after
  `max_rollbacks` of them, the next spike stops the run (exit 4). With no checkpoint yet, the
  spike's step is skipped instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Callable

import torch

from trainer.checkpoint.states import TrainState
from trainer.errors import TrainingError


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


@dataclasses.dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    mean: float
    std: float
    window: int  # losses in the window
    action: str = "log"  # log, skip, rollback or stop (spike_action)
    checkpoint: int | None = None  # on_spike = rollback: this run's newest checkpoint

    def describe(self, threshold: float) -> str:
        return (
            f"{self.loss:.4f} > mean {self.mean:.4f} + {threshold:g} x std {self.std:.4f} "
            f"of the previous {self.window} steps"
        )


def spike_action(on_spike: str, rollbacks: int, max_rollbacks: int, checkpoint: int | None) -> str:
    """What a spike does: `on_spike`; but a rollback beyond `max_rollbacks` stops the run, and
    one with no checkpoint to go back to skips the step instead."""
    if on_spike != "rollback":
        return on_spike
    if rollbacks >= max_rollbacks:
        return "stop"
    return "skip" if checkpoint is None else "rollback"


class LossGuard:
    def __init__(self, training_cfg, *, log, metrics, state: TrainState | None = None):
        self.max_skipped = training_cfg.max_skipped_steps
        self.threshold = training_cfg.spike_threshold
        self.on_spike, self.max_rollbacks = training_cfg.on_spike, training_cfg.max_rollbacks
        self.window: deque[float] = deque(maxlen=training_cfg.spike_window)
        self.state = state if state is not None else TrainState()  # holds window and rollbacks
        self.log, self.metrics = log, metrics
        self.streak: list[tuple[int, str]] = []  # consecutive skipped steps, and why
        self.skipped = self.spikes = 0
        self.restore()

    # -- the window ----------------------------------------------------------------------
    def restore(self) -> None:
        """Take the window from the train state (at start, after a rollback); no streak."""
        self.window = deque(self.state.loss_window, maxlen=self.window.maxlen)
        self.streak = []

    def record(self, loss: float) -> None:
        if self.window.maxlen and math.isfinite(loss):
            self.window.append(loss)
            self.state.loss_window = list(self.window)

    def detect(self, step: int, loss: float) -> Spike | None:
        """A spike when the window is full and `loss` is above its mean + threshold x std."""
        if (
            not self.window.maxlen
            or len(self.window) < self.window.maxlen
            or not math.isfinite(loss)
        ):
            return None
        mean = sum(self.window) / len(self.window)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / len(self.window))
        if loss > mean + self.threshold * std:
            return Spike(step, loss, mean, std, len(self.window))
        return None

    def _count(self, spike: Spike) -> None:
        self.spikes += 1
        self.metrics.log_scalars(spike.step, {"loss_metrics/spikes": self.spikes})

    # -- steps ---------------------------------------------------------------------------
    def good_step(self, step: int, loss: float) -> None:
        """A step that updated the weights: end any streak. With on_spike = "log", look for a
        spike and add the loss to the window (the other modes did both before the step)."""
        self.streak = []
        if self.on_spike != "log":
            return
        spike = self.detect(step, loss)
        if spike is not None:
            self._count(spike)
            self.log(
                f"loss spike at step {step}: {spike.describe(self.threshold)} "
                f"({self.spikes} so far)"
            )
        self.record(loss)

    def before_update(
        self, step: int, loss: float, newest_checkpoint: Callable[[], int | None]
    ) -> Spike | None:
        """on_spike != "log", before the optimizer step, on the global mean loss (so every
        rank decides alike): None to step (the loss joins the window), else the spike with
        its action. `newest_checkpoint()` is asked only when a rollback is in question."""
        spike = self.detect(step, loss)
        if spike is None:
            self.record(loss)
            return None
        self._count(spike)
        checkpoint = newest_checkpoint() if self.on_spike == "rollback" else None
        action = spike_action(
            self.on_spike, len(self.state.rollback_steps), self.max_rollbacks, checkpoint
        )
        return dataclasses.replace(spike, action=action, checkpoint=checkpoint)

    def skipped_step(
        self, step: int, avg_loss: float, grad_norm: float, last_checkpoint: str
    ) -> None:
        """Record a skipped non-finite step; raise TrainingError once the streak exceeds the
        limit."""
        self._skip(step, "loss" if not math.isfinite(avg_loss) else "grad norm")
        self.log(
            f"step {step}: skipped the optimizer step (loss {avg_loss}, grad_norm "
            f"{grad_norm}); {len(self.streak)} in a row, at most "
            f"{self.max_skipped} allowed (training.max_skipped_steps); no checkpoint is saved "
            "at a skipped step"
        )
        self._check_streak(last_checkpoint)

    def skipped_spike(self, spike: Spike, last_checkpoint: str) -> None:
        """A spike whose optimizer step was skipped: one line; the streak as for a non-finite
        step (its loss stays out of the window)."""
        self._skip(spike.step, "spike")
        what = (
            "no checkpoint to roll back to yet: skipped its optimizer step instead"
            if self.on_spike == "rollback"
            else "skipped its optimizer step"
        )
        self.log(
            f"loss spike at step {spike.step}: {spike.describe(self.threshold)} "
            f"({self.spikes} so far); {what} (training.on_spike = {self.on_spike!r}); "
            f"{len(self.streak)} in a row, at most {self.max_skipped} allowed "
            "(training.max_skipped_steps); no checkpoint is saved at a skipped step"
        )
        self._check_streak(last_checkpoint)

    def rolled_back(self, spike: Spike) -> None:
        """After every rank reloaded `spike.checkpoint` and recorded this rollback in the train
        state: one line, the count, and the window the checkpoint had."""
        n = len(self.state.rollback_steps)
        self.metrics.log_scalars(spike.step, {"loss_metrics/rollbacks": n})
        self.log(
            f"loss spike at step {spike.step}: {spike.describe(self.threshold)} "
            f"({self.spikes} so far); rolled back to checkpoint step-{spike.checkpoint} "
            f"(rollback {n}, at most {self.max_rollbacks}: training.max_rollbacks); step "
            f"{spike.step} will pass over one global batch, the one it spiked on"
        )
        self.restore()

    def rollbacks_exhausted(self, spike: Spike) -> TrainingError:
        n = len(self.state.rollback_steps)
        last = "none" if spike.checkpoint is None else f"step-{spike.checkpoint}"
        return TrainingError(
            f"loss spike at step {spike.step}: {spike.describe(self.threshold)},"
            f" after {n} rollback{'' if n == 1 else 's'} (at most "
            f"{self.max_rollbacks}: training.max_rollbacks); last checkpoint "
            f"{last}"
        )

    def _skip(self, step: int, why: str) -> None:
        self.streak.append((step, why))
        self.skipped += 1
        self.metrics.log_scalars(step, {"loss_metrics/skipped_steps": self.skipped})

    def _check_streak(self, last_checkpoint: str) -> None:
        if len(self.streak) <= self.max_skipped:
            return
        whys = {why for _, why in self.streak}
        what = (
            "non-finite loss"
            if "loss" in whys
            else "non-finite grad norm"
            if "grad norm" in whys
            else ""
        )
        if "spike" in whys:
            spikes = (
                "a loss spike" if [w for _, w in self.streak].count("spike") == 1 else "loss spikes"
            )
            what = f"{what} and {spikes}" if what else spikes
        first, last = self.streak[0][0], self.streak[-1][0]
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        raise TrainingError(f"{what} at {steps}; last checkpoint {last_checkpoint}")
