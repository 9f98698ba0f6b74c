"""What the loop does about a bad step (trainer/health/guard.py decides): log a skipped step, act
on a loss spike (`training.on_spike`: skip, or roll back to the newest checkpoint and pass
over the spiking step's global batch), and pass over the windows of `training.skip_data_steps`.
Every function runs on every rank alike: the decisions come from reduced values."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.states import TrainState
from trainer.distributed import log0, reduce_loss
from trainer.errors import DataError, UserError
from trainer.health.guard import LossGuard, Spike
from trainer.observe.metrics import MetricsProcessor


def check_data_skips(training, loader) -> None:
    """Passing over global batches (rollbacks, skip_data_steps) needs a global sample order."""
    if hasattr(loader, "skip_global_batch"):
        return
    for key, used in (
        ("training.on_spike = 'rollback'", training.on_spike == "rollback"),
        ("training.skip_data_steps", bool(training.skip_data_steps)),
    ):
        if used:
            raise DataError(
                f"{key} passes over global batches, which needs a data source with "
                "a global order (a token store, stdlib, synthetic or a blend); a "
                "streamed dataset has none: prepare a store (python -m "
                "trainer.data.prepare), or use training.on_spike = 'skip'"
            )


def skipped_step(
    guard: LossGuard,
    checkpointer: Checkpointer,
    step: int,
    loss_share,
    rank_loss,
    grad_norm,
    dp_group,
) -> None:
    """Every rank alike (the decision came from the reduced grad norm): log the skip; when
    there were too many in a row, commit any save in flight and stop with TrainingError."""
    avg, _ = reduce_loss(loss_share, rank_loss, dp_group)
    try:
        guard.skipped_step(step, avg, float(grad_norm), last_checkpoint(checkpointer))
    except UserError:
        checkpointer.wait()
        raise


def last_checkpoint(checkpointer: Checkpointer) -> str:
    steps = checkpointer.committed_steps() if checkpointer.cfg.enable else []
    if checkpointer.pending is not None:  # an async save from a good step: the newest one
        steps.append(checkpointer.pending[0])
    return f"step-{max(steps)}" if steps else "none"


def spike_check(guard: LossGuard, checkpointer: Checkpointer, device, dp_size: int):
    """training.on_spike != "log": the check the step (trainer/step.py) runs before the optimizer
    step, on the token-weighted mean loss (one extra one-element all-reduce), so every rank decides
    alike (trainer/health/guard.py). A rollback is in question only on a spike: then an async save
    in flight, the newest checkpoint, is committed first (every rank is here together)."""
    state = guard.state

    def newest_checkpoint() -> int | None:
        checkpointer.wait()
        return checkpointer.latest

    def check(loss_share: torch.Tensor) -> Spike | None:
        total = loss_share.detach().float().reshape(()).clone()
        dist.all_reduce(total)  # the same value as agree_at_step_end's, one step earlier
        replicas = dist.get_world_size() // dp_size  # tp ranks hold the same share
        return guard.before_update(state.step, total.item() / replicas, newest_checkpoint)

    return check


def act_on_spike(
    spike: Spike,
    guard: LossGuard,
    checkpointer: Checkpointer,
    state: TrainState,
    metrics: MetricsProcessor,
) -> bool:
    """Every rank alike: skip the step (a line; too many in a row stop the run), roll back
    (True: the loop goes on from the checkpoint's step), or stop with TrainingError."""
    if spike.action == "rollback":
        roll_back(spike, guard, checkpointer, state, metrics)
        return True
    try:
        if spike.action == "stop":
            raise guard.rollbacks_exhausted(spike)
        guard.skipped_spike(spike, last_checkpoint(checkpointer))
    except UserError:
        checkpointer.wait()
        raise
    return False


def roll_back(
    spike: Spike,
    guard: LossGuard,
    checkpointer: Checkpointer,
    state: TrainState,
    metrics: MetricsProcessor,
) -> None:
    """Reload this run's newest checkpoint (model, optimizer, lr schedule, data position, RNG,
    train state with its spike window), record that step `spike.step` passes over one global
    batch, and commit the record at once by saving the same step again (replacing it): a crash
    from here on resumes with it, and the rollbacks stay counted."""
    checkpointer.load(spike.checkpoint, quiet=True)
    state.rollback_steps.append(spike.step)
    guard.rolled_back(spike)
    checkpointer.save(spike.checkpoint, replace=True)
    checkpointer.wait()
    metrics.restart_interval()  # the steps since the checkpoint are trained again


def pass_over(loader, step: int, skip_data_steps: list[int], rollback_steps: list[int]) -> None:
    """Before step `step` fetches its data, pass over one global batch (of the loader's current
    size) per entry of `step` in training.skip_data_steps and in the rollbacks' record."""
    n = skip_data_steps.count(step) + rollback_steps.count(step)
    if not n:
        return
    first = loader.consumed
    for _ in range(n):
        loader.skip_global_batch()
    why = " and ".join(
        what
        for what, hit in (
            ("training.skip_data_steps", step in skip_data_steps),
            ("a rollback from a spike at this step", step in rollback_steps),
        )
        if hit
    )
    log0(
        f"step {step}: passed over {n} global batch{'es' if n > 1 else ''}, samples "
        f"{first}-{loader.consumed - 1} ({why})"
    )


def note_past_skips(skip_data_steps: list[int], resumed_at: int) -> None:
    past = sorted({s for s in skip_data_steps if s <= resumed_at})
    if past:
        log0(
            f"training.skip_data_steps: step(s) {', '.join(map(str, past))} are not after "
            f"the resumed step {resumed_at}: nothing is passed over there now"
        )
