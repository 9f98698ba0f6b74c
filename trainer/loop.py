"""The training loop: a step, then its duties in a fixed order.

`Loop.run` is an explicit sequence of small methods, as torchtitan's `train()` is, rather than
callbacks: the order of the duties matters (a spike's rollback must come before validation sees
the weights, the save before the step-end agreement that may stop the run), and one screen shows
it. A new duty is a method here and a line in `after_step`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.checkpoint import lease
from trainer.checkpoint import retry as store_retry
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.distributed import (
    log0,
    reduce_loss,
    reduce_mean,
    reduce_z_loss,
    set_collective_timeout,
    to_device,
)
from trainer.errors import CheckpointError
from trainer.evals.evaluator import log_evals
from trainer.evals.validate import log_validation
from trainer.health import heartbeat
from trainer.health.guard import LossGuard
from trainer.health.oom import out_of_memory
from trainer.health.preemption import Preempted, StopSignals
from trainer.health.spikes import act_on_spike, note_past_skips, pass_over, skipped_step
from trainer.health.stragglers import StragglerWatch
from trainer.optim.batch_schedule import next_batch
from trainer.parallel.float8 import after_optimizer_step
from trainer.plan.measured import describe as describe_fit
from trainer.plan.measured import measured_fit
from trainer.step import StepResult, TrainStep

AUX = "moe/aux_loss"  # MoE's weighted aux + router z-loss terms (trainer/models/common/moe.py)


class Loop:
    """Train until `training.steps`, or until a stop signal (then save and raise Preempted),
    or until too many skipped steps in a row or spikes beyond the rollbacks (TrainingError)."""

    def __init__(
        self,
        cfg,
        train_step: TrainStep,
        checkpointer: Checkpointer,
        metrics,
        profiler,
        state,
        guard: LossGuard,
        stop: StopSignals,
        *,
        validator=None,
        evaluator=None,
    ):
        self.cfg, self.train_step, self.checkpointer = cfg, train_step, checkpointer
        self.metrics, self.profiler, self.state, self.guard = metrics, profiler, state, guard
        self.stop, self.validator, self.evaluator = stop, validator, evaluator
        self.loader, self.device, self.dp_group = (
            train_step.loader,
            train_step.device,
            train_step.dp_group,
        )
        self.first_step = state.step + 1
        self.watch = StragglerWatch(
            cfg.health.straggler_factor,
            cfg.health.straggler_steps,
            dist.get_rank(),
            dist.get_world_size(),
            log0,
        )
        train_step.work_done = self.watch.stop_step  # before post-step collectives

    def run(self) -> None:
        steps = self.cfg.training.steps
        if self.state.step >= steps:
            log0(f"nothing to do: already at step {self.state.step} of {steps}")
        note_past_skips(self.cfg.training.skip_data_steps, self.state.step)
        while self.state.step < steps:
            result = self.step()
            self.after_step(result, last=self.state.step == steps)
        self.checkpointer.wait()
        log0(f"training done at step {self.state.step}")

    def after_step(self, r: StepResult, last: bool) -> None:
        """The duties after a step, in order. The step-end agreement comes first: it is the
        step's one host sync, and it says whether the optimizer stepped (on the device)."""
        step = self.state.step
        stop_now, async_done, avg_loss, r, lost = self.agree_at_step_end(r)
        if lost:  # another run took the folder over (this one was frozen past the timeout)
            raise lease_lost(step)
        log_step = step % self.cfg.metrics.log_freq == 0 or last or step == self.first_step
        if step == self.first_step + 1:  # before the log resets the peaks
            self.memory_fit(step)
        if log_step:
            self.log(r)
        if self.bad_step(r):
            return  # rolled back: the loop goes on from the checkpoint's step
        self.validate(last)
        self.evaluate(last)
        self.profiler.step()
        heartbeat.phase("checkpoint")
        # A skipped step saves no checkpoint, but the last one does: the run ends with one.
        saved = (r.stepped or last) and self.checkpointer.maybe_save(step, last=last)
        if saved and not r.stepped:
            log0(
                f"step {step}, the last, skipped its optimizer step: saved its checkpoint "
                f"anyway (the weights of the last step taken)"
            )
        if log_step:  # every rank's time, gathered by the agreement
            self.metrics.log_scalars(step, self.watch.scalars)
        if r.stepped:
            self.guard.good_step(step, avg_loss)
        if async_done:  # every rank's background write of an async save has finished
            self.checkpointer.wait()
        if stop_now and not last:
            self.stop_and_save(saved)
        if step == self.first_step:  # setup and step 1 may be slow; then a tighter bound
            set_collective_timeout(self.cfg.comm.train_timeout_seconds)

    def step(self) -> StepResult:
        """The next step: its batch size (a ramp), data passed over, the step, float8's scales."""
        cfg, state = self.cfg, self.state
        state.step += 1
        self.metrics.step_timer()
        self.watch.start_step()
        accum = next_batch(cfg, self.loader, state.step)  # a batch-size ramp sets the batch
        pass_over(self.loader, state.step, cfg.training.skip_data_steps, state.rollback_steps)
        try:
            r = self.train_step(state.step, accum)
        except torch.OutOfMemoryError:  # rank-local: one line, see trainer/health/oom.py
            raise out_of_memory(cfg, state.step, self.device) from None
        self.watch.stop_step()
        # float8's scales for the next all-gather (the same weights again after a skipped step)
        after_optimizer_step(self.train_step.model, cfg.float8)
        state.tokens_seen += cfg.training.seq_len * self.loader.global_batch_size
        for event in self.loader.pop_events():  # e.g. a blend's source starting a new epoch
            log0(f"data: step {state.step}: {event}")
        return r

    def log(self, r: StepResult) -> None:
        heartbeat.phase("log")
        step, loader, seq_len = self.state.step, self.loader, self.cfg.training.seq_len
        avg, mx = reduce_loss(r.loss_share, r.rank_loss, self.dp_group)
        # MTP: the ranks' shares of the global mean per token (None without MTP modules)
        mtp = reduce_z_loss(r.mtp_loss, self.dp_group)
        self.metrics.log(
            step,
            global_avg_loss=avg,
            global_max_loss=mx,
            grad_norm=float(r.grad_norm),
            lr=r.lr,
            tokens_seen=self.state.tokens_seen,
            local_loss=r.rank_loss.item(),
            z_loss=reduce_z_loss(r.z_loss, self.dp_group),
            mtp_loss=mtp,
        )
        scalars = {k: float(v) for k, v in (r.scalars or {}).items() if k != AUX}
        if r.scalars and AUX in r.scalars:  # each rank's own microbatches: their dp mean
            scalars[AUX] = reduce_mean(r.scalars[AUX], self.dp_group)
        self.metrics.log_scalars(
            step,
            {
                **loader.metrics(),
                **store_retry.metrics(self._sum_over_ranks),
                "batch_metrics/global_batch_size": loader.global_batch_size,
                "batch_metrics/step_tokens": seq_len * loader.global_batch_size,
                **scalars,
            },
        )

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        """Counts summed over every rank (object-store retries: each rank sends its own)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def memory_fit(self, step: int) -> None:
        """On a GPU, rank 0 says the largest local batch that fits by this step's measured
        peak (trainer/plan/measured.py): compile keeps less than the eager plan counts.
        Pipeline ranks hold different stages, so only runs without PP say it."""
        if self.device.type != "cuda" or dist.get_rank() != 0 or self.train_step.pp > 1:
            return
        peak = torch.cuda.memory_stats(self.device).get("active_bytes.all.peak", 0)
        gib = torch.cuda.get_device_properties(self.device).total_memory / 2**30
        fit = measured_fit(self.cfg, dist.get_world_size(), peak, gib)
        log0(describe_fit(self.cfg, step, peak, gib, fit))

    def bad_step(self, r: StepResult) -> bool:
        """A spike is skipped, rolled back (True) or stops the run; a non-finite step is
        counted (too many in a row stop the run)."""
        if r.spike is not None:
            return act_on_spike(r.spike, self.guard, self.checkpointer, self.state, self.metrics)
        if not r.stepped:
            skipped_step(
                self.guard,
                self.checkpointer,
                self.state.step,
                r.loss_share,
                r.rank_loss,
                r.grad_norm,
                self.dp_group,
            )
        return False

    def validate(self, last: bool) -> None:
        heartbeat.phase("validation")
        v = self.validator
        if v is not None and v.due(self.state.step, last):
            log_validation(
                self.state.step, v.run(self.train_step.model), v.seconds, self.metrics, log0
            )

    def evaluate(self, last: bool) -> None:
        heartbeat.phase("eval")
        e = self.evaluator
        if e is not None and e.due(self.state.step, last):
            log_evals(self.state.step, e.run(self.train_step.model), e.seconds, self.metrics, log0)

    def agree_at_step_end(self, r: StepResult) -> tuple[bool, bool, float, StepResult, bool]:
        """One tiny all-reduce per step, the step's one host sync: (any rank got a stop
        signal, every rank's async save in flight has finished writing, so it can be committed
        now rather than at the next save, the token-weighted mean loss for the spike detector,
        the step with `stepped` read from the device, another run took a lease of rank 0's).
        It also gathers every rank's step time for the straggler watch (one slot per rank)."""
        heartbeat.phase("step_end")
        stepped = r.stepped
        host = torch.tensor(
            [
                1.0 if self.stop.received else 0.0,
                0.0 if self.checkpointer.write_finished() else 1.0,
                0.0,
                0.0,
                1.0 if lease.lost() else 0.0,
                *self.watch.slots(),
            ]
        )
        flags = to_device(host, self.device)
        flags[2] = r.loss_share.detach().float().reshape(())
        if isinstance(stepped, torch.Tensor):  # the same on every rank (a reduced norm)
            flags[3] = (~stepped).float().reshape(())
        dist.all_reduce(flags)  # SUM: counts of ranks for the flags, each rank's own time slot
        stop_now, not_done, loss_sum, skipped, lost, *times = flags.tolist()
        self.watch.update(self.state.step, times)
        if isinstance(stepped, torch.Tensor):
            r = r._replace(stepped=skipped == 0)
        # every dp rank's share once per model-parallel rank (tp) that holds it
        replicas = dist.get_world_size() // dist.get_world_size(self.dp_group)
        return (
            stop_now > 0,
            self.checkpointer.pending is not None and not_done == 0,
            loss_sum / replicas,
            r,
            lost > 0,
        )

    def stop_and_save(self, saved: bool) -> None:
        """Save at this step boundary (unless the periodic save just did) and raise Preempted."""
        cfg, step = self.cfg, self.state.step
        what = "saving" if cfg.checkpoint.enable else "checkpointing is off, not saving"
        log0(
            f"stop signal ({self.stop.received or 'on another rank'}) at step {step}: {what}, "
            "exiting"
        )
        if cfg.checkpoint.enable and not saved:
            self.checkpointer.save(step)
        self.checkpointer.wait()
        raise Preempted(f"stopped at step {step} on a signal")


def lease_lost(step: int) -> CheckpointError:
    """Every rank's error after another run took this one's folder (rank 0 prints it): no
    save into a folder that is not this run's any more, where its checkpoint retention
    would delete the other run's."""
    error = CheckpointError(
        f"this run lost the lease on {lease.lost() or 'its folder'} at "
        f"step {step}: stopping without saving, the folder is the other "
        "run's now"
    )
    error.agreed = True
    return error
