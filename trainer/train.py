"""The training loop. Run under torchrun (see run_train.sh):

    python -m trainer.train --job.config_file configs/debug_model.toml [--section.key value ...]

Config -> process group -> ParallelDims mesh -> Llama on meta -> FSDP2/HSDP -> optimizer ->
data -> resume from the latest checkpoint -> for each step: microbatches with gradient
accumulation, clip, optimizer and scheduler step, log, save. A non-finite loss skips the
optimizer step; a loss spike is logged, skipped or rolled back (trainer/health/guard.py, `roll_back`).
"""

from __future__ import annotations

import signal

EARLY_SIGNALS: list[int] = []
if __name__ == "__main__":
    # A rank can be signalled as soon as it exists (the launcher forwards SLURM's SIGUSR1 at
    # once), while it still imports torch or loads a checkpoint: record the signals until
    # run_loop's StopSignals takes over, instead of dying of them.
    for _name in ("SIGTERM", "SIGUSR1", "SIGINT", "SIGUSR2", "SIGHUP"):
        signal.signal(getattr(signal, _name), lambda signum, frame: EARLY_SIGNALS.append(signum))

import math  # noqa: E402
import os
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from trainer.health import heartbeat, restarts
from trainer.checkpoint.checkpointer import Checkpointer, TrainState
from trainer.config.job import JobConfig, load_config
from trainer.device import Precision, resolve_compute_dtype
from trainer.models.attention import attention_args
from trainer.data import build_dataloader, check_model_vocab, padded_vocab_size
from trainer.data.documents import check_documents
from trainer.distributed import (DEBUG_DATA_ENV, agree_on_user_errors,  # noqa: F401
                                 init_distributed, log0, print_sample_hashes, reduce_loss,
                                 reduce_z_loss, set_collective_timeout)
from trainer.optim.batch_schedule import describe_ramp, next_batch
from trainer.errors import DataError, UserError
from trainer.evals.evaluator import Evaluator, log_evals
from trainer.parallel.float8 import after_optimizer_step, check_device as check_float8_device
from trainer.health.guard import LossGuard, Spike, flag_nonfinite_loss, injected_nan, injected_spike
from trainer.hf.load import load_initial, save_last_hf
from trainer.models.loss import IGNORE_INDEX, Loss, build_loss
from trainer.observe.metrics import MetricsProcessor
from trainer.health.oom import (OOM_EXIT_CODE, OutOfMemory, claim_report, inject_oom, out_of_memory,
                         peer_ran_out_of_memory)
from trainer.models.llama import build_model, model_args
from trainer.optim.optimizer import build_lr_scheduler, build_optimizer
from trainer.parallel.clip import clip_grad_norm_
from trainer.parallel.dims import check_async_tp, check_tp_shapes, describe_vocab
from trainer.parallel.parallelize import parallelize, set_gradient_sync
from trainer.health.preemption import PREEMPTED_EXIT_CODE, Preempted, StopSignals
from trainer.health.heartbeat import HANG_EXIT_CODE
from trainer.observe.profiling import StepProfiler
from trainer.health.spikes import (act_on_spike, check_data_skips, note_past_skips, pass_over,
                            skipped_step, spike_check)
from trainer.health.stragglers import StragglerWatch, injected_delay
from trainer.evals.validate import Validator, log_validation


def filter_output() -> None:
    """Keep stdout only on the ranks listed in LOG_RANK (e.g. "0" or "0,1"; default all).
    stderr is never filtered, so a crash on any rank shows its traceback."""
    wanted = os.environ.get("LOG_RANK")
    if wanted and os.environ.get("RANK", "0") not in {r.strip() for r in wanted.split(",")}:
        sys.stdout = open(os.devnull, "w")


def choose_precision(cfg: JobConfig, device: torch.device) -> Precision:
    """The compute dtype `training.mixed_precision_param` stands for here; every rank agrees
    (bf16 only if every rank's CPU computes it natively)."""

    def native_everywhere(native: bool) -> bool:
        flag = torch.tensor([1 if native else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    precision = resolve_compute_dtype(cfg.training.mixed_precision_param,
                                      cfg.training.mixed_precision_reduce, device,
                                      native_everywhere=native_everywhere)
    if precision.warning and dist.get_rank() == 0:
        print(precision.warning, file=sys.stderr, flush=True)
    return precision


class StepResult(NamedTuple):
    rank_loss: torch.Tensor  # this rank's mean cross-entropy
    grad_norm: torch.Tensor
    lr: float
    stepped: bool  # False, on every rank alike, when the optimizer step was skipped
    z_loss: torch.Tensor | None
    spike: Spike | None = None  # what `spike_check` found before the optimizer step


def train_step(model, optimizer, scheduler, loader, *, accum: int, sync_mode: str, dp_group,
               max_norm: float, metrics: MetricsProcessor, loss_fn: Loss, step: int = 0,
               device=None, spike_check=None) -> StepResult:
    """One optimizer step over `accum` microbatches. `stepped` is False, on every rank alike,
    when the loss of any rank or the grad norm was not finite, or when `spike_check(rank_loss)`
    (training.on_spike != "log": called before the optimizer step when the grad norm is finite)
    found a spike: the optimizer step is then skipped (trainer/health/guard.py). The z-loss is None
    without one, else this rank's z-loss term / the global token count (summed over the dp
    ranks: the global mean per token).

    Each microbatch's loss is its summed token loss divided by the GLOBAL token count of the
    step. FSDP averages gradients over the dp ranks (dividing by the dp size: a custom
    divide factor needs PREMUL_SUM, which gloo lacks), so the backward loss is scaled by the dp
    size to make the reduced gradient a plain sum: the result equals one large batch on any
    world size and any number of microbatches.
    """
    heartbeat.phase("step_start", step)
    heartbeat.inject_fault(step)  # testing hooks; nothing unless asked
    spike_factor = injected_spike(loader)  # 1.0 unless asked
    debug_ids = None
    if os.environ.get(DEBUG_DATA_ENV):  # where each sample comes from, if the order is global
        debug_ids = loader.sample_ids(loader.sample_indices(0)) \
            if hasattr(loader, "sample_indices") else []
    with metrics.data_timer():
        batches = [loader.next_microbatch() for _ in range(accum)]
    if debug_ids is not None:
        print_sample_hashes(batches, dp_group, debug_ids)
    device = device or next(model.parameters()).device  # params are on the CPU with offload
    local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
    global_tokens = torch.tensor(float(local_tokens), device=device)
    dist.all_reduce(global_tokens, group=dp_group)
    dp_size = dist.get_world_size(dp_group)
    loss_sum = torch.zeros((), device=device)
    documents = model.uses_documents
    for i, (inputs, labels) in enumerate(batches):
        set_gradient_sync(model, sync_mode, is_last=i == accum - 1)
        inputs = inputs.to(device)
        heartbeat.phase("forward", step)
        # The model's head computes the summed token loss (trainer/models/loss.py): no logits here.
        # Document ids (None without documents) let the model mask and position per document.
        loss = model(inputs, labels=labels.to(device), loss_fn=loss_fn,
                     doc_ids=loader.document_ids(inputs) if documents else None) / global_tokens
        if i == 0:
            inject_oom(step)  # testing hook; nothing unless asked
        heartbeat.phase("backward")
        (loss * dp_size).backward()
        loss_sum += loss.detach()
    z_loss = loss_fn.take_z_loss()  # the z-loss term summed over this rank's tokens, or None
    if z_loss is not None:
        z_loss = z_loss / global_tokens
    if spike_factor != 1.0:
        loss_sum = loss_sum * spike_factor
    loss_sum = loss_sum + injected_nan(step)  # testing hook; 0.0 unless asked
    flag_nonfinite_loss(model, loss_sum)  # a rank's bad loss makes the global norm NaN
    heartbeat.phase("clip")
    grad_norm = clip_grad_norm_(model.parameters(), max_norm or math.inf)  # over every mesh dim
    lr = optimizer.param_groups[0]["lr"]  # the lr this step uses (the scheduler steps after it)
    cross_entropy = loss_sum if z_loss is None else loss_sum - z_loss
    rank_loss = cross_entropy * global_tokens / max(local_tokens, 1)
    stepped = bool(torch.isfinite(grad_norm))  # the same on every rank: a reduced value
    spike = spike_check(rank_loss) if stepped and spike_check is not None else None
    stepped = stepped and spike is None
    if stepped:
        optimizer.step()
    injected_delay()  # testing hook: a slow rank
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    metrics.count_tokens(local_tokens)
    return StepResult(rank_loss, grad_norm, lr, stepped, z_loss, spike)


def train(cfg: JobConfig) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    parallel_dims, accum = cfg.resolve(world_size)  # config errors before any process group
    restarts.check_restart(cfg.job.dump_folder, cfg.health.max_same_failures)
    device = init_distributed(cfg)
    heartbeat.note_timeout(cfg.comm.init_timeout_seconds)
    heartbeat.Heartbeat(cfg.health.heartbeat_seconds).start()
    if dist.get_rank() == 0:
        cfg.save(os.path.join(cfg.job.dump_folder, "config.toml"))
    precision = choose_precision(cfg, device)
    agree_on_user_errors(check_float8_device, cfg.float8, device)
    parallel_dims.build_mesh(device.type)
    dp_mesh = parallel_dims.dp_mesh
    dp_group = dp_mesh.get_group()
    gbs = cfg.training.local_batch_size * parallel_dims.dp_size * accum

    loader = agree_on_user_errors(
        build_dataloader, cfg.data, seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size, global_batch_size=gbs,
        dp_rank=dp_mesh.get_local_rank(), dp_size=dp_mesh.size(), seed=cfg.job.seed)
    if cfg.training.rampup_batch_start and not hasattr(loader, "set_global_batch_size"):
        raise DataError("training.rampup_batch_start needs a data source with a global order "
                        "(a token store, stdlib, synthetic or a blend); a streamed dataset "
                        "cannot change its batch size: prepare a store")
    vocab = cfg.model.vocab_size or padded_vocab_size(loader.vocab_size,
                                                      cfg.model.vocab_size_multiple_of)
    agree_on_user_errors(check_model_vocab, vocab, loader)
    check_data_skips(cfg.training, loader)
    agree_on_user_errors(check_documents, cfg.model, loader)  # block_causal needs documents
    validator = None
    if cfg.validation.enable:
        validator = agree_on_user_errors(
            Validator, cfg, train_loader=loader, dp_rank=dp_mesh.get_local_rank(),
            dp_size=dp_mesh.size(), dp_group=dp_group, device=device, log=log0)
    evaluator = agree_on_user_errors(
        Evaluator, cfg, tokenizer_path=loader.tokenizer_path, dp_rank=dp_mesh.get_local_rank(),
        dp_size=dp_mesh.size(), dp_group=dp_group, device=device) if cfg.eval.enable else None
    args = model_args(cfg.model.flavor, vocab_size=vocab, max_seq_len=cfg.training.seq_len,
                      **attention_args(cfg.model, device.type))
    agree_on_user_errors(check_tp_shapes, args, parallel_dims.tp, cfg.model.flavor,
                         describe_vocab(cfg.model, loader.vocab_size))
    agree_on_user_errors(check_async_tp, cfg.parallelism, cfg.compile.enable, device.type)

    model = parallelize(build_model(args), parallel_dims, cfg, device=device,
                        param_dtype=precision.param)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    state = TrainState()
    # Rank 0 opens TensorBoard and W&B: a W&B run that cannot start stops every rank alike.
    metrics = agree_on_user_errors(
        MetricsProcessor, cfg, model_args=args, seq_len=cfg.training.seq_len, device=device,
        rank=dist.get_rank(), parallel_desc=parallel_dims.describe(), precision=precision,
        accumulation_steps=accum, num_params=args.num_params(),
        model_parallel=parallel_dims.tp)
    with metrics:  # closed with the run's exit code (W&B records it)
        metrics.log_startup()
        log0(f"data: {loader.describe()}")
        if cfg.training.rampup_batch_start:
            log0(describe_ramp(cfg.training, loader))
        for check in (validator, evaluator):
            if check is not None:
                log0(check.describe())
        checkpointer = Checkpointer(cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                                    dataloader=loader, train_state=state, log=log0)
        if not checkpointer.load(agree_on_user_errors(checkpointer.step_to_load,
                                                      same_result=True)):
            agree_on_user_errors(load_initial, model, cfg, log=log0)  # initial_load_path
        restarts.note_restart(metrics, state.step, log0)
        for event in loader.pop_events():  # e.g. a blend resumed with other weights
            log0(f"data: resuming after step {state.step}: {event}")
        with StepProfiler(cfg, rank=dist.get_rank(), device=device,
                          start_step=state.step) as profiler:
            run_loop(cfg, model, optimizer, scheduler, loader, checkpointer, metrics, profiler,
                     state, dp_group=dp_group, device=device, validator=validator,
                     evaluator=evaluator, loss_group=parallel_dims.loss_parallel_group)
        if cfg.checkpoint.last_save_in_hf:
            save_last_hf(model, cfg, log=log0)


def run_loop(cfg, model, optimizer, scheduler, loader, checkpointer, metrics, profiler, state,
             *, dp_group, device, validator=None, evaluator=None, loss_group=None) -> None:
    """Train until `training.steps`, or until a stop signal (then save and raise Preempted),
    or until too many skipped steps in a row or spikes beyond the rollbacks (TrainingError)."""
    stop = StopSignals(cfg.job.stop_signals, early=EARLY_SIGNALS)
    guard = LossGuard(cfg.training, log=log0, metrics=metrics, state=state)
    check = None if cfg.training.on_spike == "log" else spike_check(guard, checkpointer, device)
    # Compiling the loss's chunks pays on GPUs; on CPU it would only add compile time.
    loss_fn = build_loss(cfg.training.loss, cfg.training.loss_chunk_size,
                         z_loss_weight=cfg.training.z_loss_weight,
                         compile_chunks=cfg.compile.enable and device.type == "cuda",
                         vocab_parallel_group=loss_group)  # loss parallel under TP, or None
    if state.step >= cfg.training.steps:
        log0(f"nothing to do: already at step {state.step} of {cfg.training.steps}")
    note_past_skips(cfg.training.skip_data_steps, state.step)
    first_step = state.step + 1
    watch = StragglerWatch(cfg.health.straggler_factor, cfg.health.straggler_steps,
                           dist.get_rank(), dist.get_world_size(), log0)
    while state.step < cfg.training.steps:
        state.step += 1
        metrics.step_timer()
        watch.start_step()
        accum = next_batch(cfg, loader, state.step)  # a batch-size ramp sets the step's batch
        pass_over(loader, state.step, cfg.training.skip_data_steps, state.rollback_steps)
        try:
            rank_loss, grad_norm, lr, stepped, z_loss, spike = train_step(
                model, optimizer, scheduler, loader, accum=accum,
                sync_mode=cfg.training.gradient_accumulation_sync, dp_group=dp_group,
                max_norm=cfg.training.max_norm, metrics=metrics, loss_fn=loss_fn,
                step=state.step, device=device, spike_check=check)
        except torch.OutOfMemoryError:  # rank-local: one line, see trainer/health/oom.py
            raise out_of_memory(cfg, state.step, device) from None
        watch.stop_step()
        if stepped:
            after_optimizer_step(model, cfg.float8)
        state.tokens_seen += cfg.training.seq_len * loader.global_batch_size
        last = state.step == cfg.training.steps
        for event in loader.pop_events():  # e.g. a blend's source starting a new epoch
            log0(f"data: step {state.step}: {event}")
        log_step = state.step % cfg.metrics.log_freq == 0 or last or state.step == first_step
        if log_step:
            heartbeat.phase("log")
            avg, mx = reduce_loss(rank_loss, dp_group)
            metrics.log(state.step, global_avg_loss=avg, global_max_loss=mx,
                        grad_norm=float(grad_norm), lr=lr,
                        tokens_seen=state.tokens_seen, local_loss=rank_loss.item(),
                        z_loss=reduce_z_loss(z_loss, dp_group))
            metrics.log_scalars(state.step, {
                **loader.metrics(), "batch_metrics/global_batch_size": loader.global_batch_size,
                "batch_metrics/step_tokens": cfg.training.seq_len * loader.global_batch_size})
        if spike is not None:
            if act_on_spike(spike, guard, checkpointer, state, metrics):
                continue  # rolled back: the loop goes on from the checkpoint's step
        elif not stepped:
            skipped_step(guard, checkpointer, state.step, rank_loss, grad_norm, dp_group)
        heartbeat.phase("validation")
        if validator is not None and validator.due(state.step, last):
            log_validation(state.step, validator.run(model), validator.seconds, metrics, log0)
        heartbeat.phase("eval")
        if evaluator is not None and evaluator.due(state.step, last):
            log_evals(state.step, evaluator.run(model), evaluator.seconds, metrics, log0)
        profiler.step()
        heartbeat.phase("checkpoint")
        saved = stepped and checkpointer.maybe_save(state.step, last=last)
        stop_now, async_done, avg_loss = agree_at_step_end(stop, checkpointer, device, rank_loss,
                                                           watch, state.step)
        if log_step:  # every rank's time, gathered by that all-reduce
            metrics.log_scalars(state.step, watch.scalars)
        if stepped:
            guard.good_step(state.step, avg_loss)
        if async_done:  # every rank's background write of an async save has finished
            checkpointer.wait()
        if stop_now and not last:
            stop_and_save(cfg, checkpointer, state.step, stop, saved)
        if state.step == first_step:  # setup and step 1 may be slow; then a tighter bound
            set_collective_timeout(cfg.comm.train_timeout_seconds)
    checkpointer.wait()
    log0(f"training done at step {state.step}")


def agree_at_step_end(stop: StopSignals, checkpointer: Checkpointer, device,
                      rank_loss: torch.Tensor, watch: StragglerWatch,
                      step: int) -> tuple[bool, bool, float]:
    """One tiny all-reduce per step: (any rank got a stop signal, every rank's async save in
    flight has finished writing, so it can be committed now rather than at the next save, the
    mean of the ranks' losses for the spike detector; the world is the dp group). It also
    gathers every rank's step time for the straggler watch (one slot per rank)."""
    heartbeat.phase("step_end")
    flags = torch.cat([torch.stack([torch.tensor(1.0 if stop.received else 0.0, device=device),
                                    torch.tensor(0.0 if checkpointer.write_finished() else 1.0,
                                                 device=device),
                                    rank_loss.detach().float().reshape(())]),
                       watch.slots(device)])
    dist.all_reduce(flags)  # SUM: counts of ranks for the flags, each rank's own time slot
    stop_now, not_done, loss_sum, *times = flags.tolist()
    watch.update(step, times)
    return (stop_now > 0, checkpointer.pending is not None and not_done == 0,
            loss_sum / dist.get_world_size())


def stop_and_save(cfg, checkpointer: Checkpointer, step: int, stop: StopSignals, saved: bool):
    """Save at this step boundary (unless the periodic save just did) and raise Preempted."""
    what = "saving" if cfg.checkpoint.enable else "checkpointing is off, not saving"
    log0(f"stop signal ({stop.received or 'on another rank'}) at step {step}: {what}, exiting")
    if cfg.checkpoint.enable and not saved:
        checkpointer.save(step)
    checkpointer.wait()
    raise Preempted(f"stopped at step {step} on a signal")


def main(argv: list[str]) -> int:
    """Entry point: user errors are one line on rank 0 and exit code 2; bugs keep tracebacks."""
    code = 1  # an unexpected exception: no final barrier (a peer may be gone)
    filter_output()
    try:
        train(load_config(argv))
        code = 0
    except OutOfMemory as e:  # this rank's alone: printed by the first rank to report one
        if claim_report():
            print(e.one_line(), file=sys.stderr, flush=True)
        code = e.exit_code
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(e.one_line(), file=sys.stderr, flush=True)
        code = e.exit_code
    except Preempted as e:
        log0(str(e))
        code = e.exit_code
    except Exception as e:  # a peer that ran out of memory, hung or died has been reported
        code = OOM_EXIT_CODE if peer_ran_out_of_memory() else heartbeat.collective_failure(e)
        if code is None:
            heartbeat.record_crash(e)  # MAX_RESTARTS stops repeating the same one
            raise
    finally:
        if dist.is_initialized() and code not in (OOM_EXIT_CODE, HANG_EXIT_CODE):
            if code in (0, PREEMPTED_EXIT_CODE):
                dist.barrier()
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # A bare interpreter exit can abort in gloo's worker threads ("terminate called without
    # an active exception"); skip the interpreter teardown once everything is flushed.
    os._exit(rc)
