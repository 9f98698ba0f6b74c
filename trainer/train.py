"""The training loop. Run under torchrun (see run_train.sh):

    python -m trainer.train --job.config_file configs/debug_model.toml [--section.key value ...]

Config -> process group -> ParallelDims mesh -> Llama on meta -> FSDP2/HSDP -> optimizer ->
data -> resume from the latest checkpoint -> for each step: microbatches with gradient
accumulation, clip, optimizer and scheduler step, log, save. A non-finite loss skips the
optimizer step; a loss spike is logged, skipped or rolled back (trainer/health/guard.py,
`roll_back`). The step is trainer/step.py, the loop's duties after it trainer/loop.py; how a step's
microbatches run forward and backward belongs to the parallelism (trainer/parallel/microbatches.py).
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

import os  # noqa: E402
import sys

import torch
import torch.distributed as dist

from trainer.checkpoint import lease
from trainer.checkpoint import retry as store_retry
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.states import TrainState
from trainer.config.job import JobConfig, load_config
from trainer.data import build_dataloader, check_model_vocab, padded_vocab_size
from trainer.data.documents import check_documents
from trainer.device import Precision, resolve_compute_dtype
from trainer.distributed import (
    agree_on_user_errors,  # noqa: F401
    check_same_config,
    init_distributed,
    log0,
    log_ranks,
    reports_user_error,
)
from trainer.errors import HANG_EXIT_CODE, OUT_OF_MEMORY_EXIT_CODE, DataError, UserError
from trainer.evals.evaluator import Evaluator
from trainer.evals.validate import Validator
from trainer.health import faults, heartbeat, restarts
from trainer.health.guard import LossGuard
from trainer.health.oom import OutOfMemory, claim_report, peer_ran_out_of_memory
from trainer.health.preemption import PREEMPTED_EXIT_CODE, Preempted, StopSignals
from trainer.health.spikes import check_data_skips, spike_check
from trainer.hf.load import load_initial, save_last_hf
from trainer.loop import Loop
from trainer.models import registry
from trainer.models.build import build_model
from trainer.models.common.attention import attention_args
from trainer.models.common.loss import build_loss, scoring_loss
from trainer.models.common.sdpa import setup as setup_sdpa
from trainer.models.flavors import model_args
from trainer.observe.metrics import MetricsProcessor
from trainer.observe.profiling import StepProfiler
from trainer.optim.batch_schedule import describe_ramp
from trainer.optim.optimizer import build_lr_scheduler, build_optimizer, lr_peaks
from trainer.optim.qk_clip import build_qk_clip
from trainer.optim.step_hooks import ExpertBalance, MTPWeight, SpikeVeto
from trainer.parallel.dims import ParallelDims, check_async_tp, check_tp_shapes, describe_vocab
from trainer.parallel.float8 import check_device as check_float8_device
from trainer.parallel.forward_backward import build_forward_backward, forward_only_split
from trainer.parallel.parallelize import parallelize
from trainer.step import TrainStep


def filter_output() -> None:
    """Keep stdout only on the ranks listed in LOG_RANK (e.g. "0" or "0,1"; default all).
    stderr is never filtered, so a crash on any rank shows its traceback."""
    # An elastic job may run below its full size (a lost node): LOG_RANK is checked against
    # the largest world it may have (trainer/launch.py), and absent ranks print nothing.
    world = os.environ.get("TRAINER_MAX_WORLD_SIZE") or os.environ.get("WORLD_SIZE", "1")
    wanted = log_ranks(os.environ.get("LOG_RANK", ""), int(world))
    if wanted is not None and int(os.environ.get("RANK", "0")) not in wanted:
        sys.stdout = open(os.devnull, "w")


def choose_precision(cfg: JobConfig, device: torch.device) -> Precision:
    """The compute dtype `training.mixed_precision_param` stands for here; every rank agrees
    (bf16 only if every rank's CPU computes it natively)."""

    def native_everywhere(native: bool) -> bool:
        flag = torch.tensor([1 if native else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    precision = resolve_compute_dtype(
        cfg.training.mixed_precision_param,
        cfg.training.mixed_precision_reduce,
        device,
        native_everywhere=native_everywhere,
    )
    if precision.warning and dist.get_rank() == 0:
        print(precision.warning, file=sys.stderr, flush=True)
    return precision


def train(cfg: JobConfig) -> None:
    """Config -> process group -> mesh -> data -> model on meta -> parallelize -> optimizer ->
    metrics -> resume -> the loop."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    parallel_dims, accum = cfg.resolve(world_size)  # config errors before any process group
    restarts.check_restart(cfg.job.dump_folder, cfg.health.max_same_failures)
    faults.arm()  # the testing hooks asked of this rank, if any (trainer/health/faults.py)
    store_retry.configure(cfg)  # object-store retries and their counts (checkpoint/retry.py)
    device = init_distributed(cfg)
    check_same_config(cfg)  # every node launched alike, before anything depends on it
    # One run per dump folder; nothing is written there before it is ours (lease.py).
    agree_on_user_errors(
        lease.take,
        cfg.job.dump_folder,
        cfg.job.lease_timeout_seconds,
        rank=dist.get_rank(),
        log=log0,
    )
    heartbeat.note_timeout(cfg.comm.init_timeout_seconds)
    heartbeat.Heartbeat(cfg.health.heartbeat_seconds).start()
    precision = choose_precision(cfg, device)
    agree_on_user_errors(check_float8_device, cfg.float8, device)
    parallel_dims.build_mesh(device.type)
    loader, vocab = build_data(cfg, parallel_dims, accum)
    validator, evaluator = build_checks(cfg, parallel_dims, loader, device)
    args = model_args(
        cfg.model.flavor,
        vocab_size=vocab,
        max_seq_len=cfg.training.seq_len,
        moe_config=cfg.moe,
        **attention_args(cfg.model, device.type),
    )
    agree_on_user_errors(
        check_tp_shapes,
        args,
        parallel_dims.tp,
        cfg.model.flavor,
        describe_vocab(cfg.model, loader.vocab_size),
    )
    agree_on_user_errors(check_async_tp, cfg.parallelism, cfg.compile.enable, device.type)
    sdpa_line = agree_on_user_errors(
        setup_sdpa, cfg.model.sdpa_backends, args, device, precision.param, cfg.training.seq_len
    )

    model = parallelize(
        build_model(args), parallel_dims, cfg, device=device, param_dtype=precision.param
    )
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_lr_scheduler(
        optimizer, cfg.lr_scheduler, cfg.training.steps, lr_peaks(cfg.optimizer)
    )
    state = TrainState()
    metrics = MetricsProcessor(
        cfg,
        model_args=args,
        seq_len=cfg.training.seq_len,
        device=device,
        rank=dist.get_rank(),
        parallel_desc=parallel_dims.describe(),
        precision=precision,
        accumulation_steps=accum,
        num_params=args.num_params(),
        model_parallel=parallel_dims.model_parallel,
    )
    with metrics:  # its sinks closed with the run's exit code (W&B records it)
        metrics.log_startup()
        log0(sdpa_line + registry.hooks(args).kernel_note(device.type))
        log0(f"data: {loader.describe()}")
        if cfg.training.rampup_batch_start:
            log0(describe_ramp(cfg.training, loader))
        for check in (validator, evaluator):
            if check is not None:
                log0(check.describe())
        checkpointer = Checkpointer(
            cfg,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            dataloader=loader,
            train_state=state,
            log=log0,
        )
        agree_on_user_errors(checkpointer.take_folder)  # e.g. another run's s3:// lease
        if not checkpointer.load(agree_on_user_errors(checkpointer.step_to_load, same_result=True)):
            agree_on_user_errors(load_initial, model, cfg, log=log0)  # initial_load_path
        # The run goes on: only now does it write its config, TensorBoard and W&B files (a
        # refused resume leaves the dump folder as it was).
        agree_on_user_errors(metrics.open)
        saved = os.path.join(cfg.job.dump_folder, "config.toml")
        if dist.get_rank() == 0 and (
            state.step < cfg.training.steps  # else nothing to do:
            or not os.path.isfile(saved)
        ):  # the run's own stays
            cfg.save(saved)
        restarts.note_restart(metrics, state.step, log0)
        for event in loader.pop_events():  # e.g. a blend resumed with other weights
            log0(f"data: resuming after step {state.step}: {event}")
        with StepProfiler(
            cfg, rank=dist.get_rank(), device=device, start_step=state.step
        ) as profiler:
            stop = StopSignals(cfg.job.stop_signals, early=EARLY_SIGNALS)
            guard = LossGuard(cfg.training, log=log0, metrics=metrics, state=state)
            train_step = build_train_step(
                cfg,
                model,
                optimizer,
                scheduler,
                loader,
                metrics,
                parallel_dims,
                device,
                guard,
                checkpointer,
            )
            Loop(
                cfg,
                train_step,
                checkpointer,
                metrics,
                profiler,
                state,
                guard,
                stop,
                validator=validator,
                evaluator=evaluator,
            ).run()
        if cfg.checkpoint.last_save_in_hf:
            save_last_hf(model, cfg, log=log0)


def build_data(cfg: JobConfig, parallel_dims: ParallelDims, accum: int):
    """The training loader over this rank's slice of the flat dp mesh, and the model's vocab."""
    dp_mesh = parallel_dims.dp_mesh
    gbs = cfg.training.local_batch_size * parallel_dims.dp_size * accum
    loader = agree_on_user_errors(
        build_dataloader,
        cfg.data,
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        global_batch_size=gbs,
        dp_rank=dp_mesh.get_local_rank(),
        dp_size=dp_mesh.size(),
        seed=cfg.job.seed,
    )
    if cfg.training.rampup_batch_start and not hasattr(loader, "set_global_batch_size"):
        raise DataError(
            "training.rampup_batch_start needs a data source with a global order "
            "(a token store, stdlib, synthetic or a blend); a streamed dataset "
            "cannot change its batch size: prepare a store"
        )
    vocab = cfg.model.vocab_size or padded_vocab_size(
        loader.vocab_size, cfg.model.vocab_size_multiple_of
    )
    agree_on_user_errors(check_model_vocab, vocab, loader)
    check_data_skips(cfg.training, loader)
    agree_on_user_errors(check_documents, cfg.model, loader)  # block_causal needs documents
    return loader, vocab


def build_checks(cfg: JobConfig, parallel_dims: ParallelDims, loader, device):
    """Validation and downstream evals (each None when off), sharded over the flat dp mesh."""
    dp_mesh = parallel_dims.dp_mesh
    # Both score through the chunked head, loss-parallel under TP: no [tokens, vocab] logits.
    loss_fn = scoring_loss(cfg.training.loss_chunk_size, parallel_dims.loss_parallel_group)
    shard = dict(
        dp_rank=dp_mesh.get_local_rank(),
        dp_size=dp_mesh.size(),
        dp_group=dp_mesh.get_group(),
        device=device,
        loss_fn=loss_fn,
    )
    split = forward_only_split(cfg, parallel_dims=parallel_dims, device=device)
    validator = (
        agree_on_user_errors(Validator, cfg, train_loader=loader, log=log0, context=split, **shard)
        if cfg.validation.enable
        else None
    )
    evaluator = (
        agree_on_user_errors(
            Evaluator, cfg, tokenizer_path=loader.tokenizer_path, context=split, **shard
        )
        if cfg.eval.enable
        else None
    )
    return validator, evaluator


def build_train_step(
    cfg: JobConfig,
    model,
    optimizer,
    scheduler,
    loader,
    metrics,
    parallel_dims: ParallelDims,
    device,
    guard: LossGuard,
    checkpointer: Checkpointer,
) -> TrainStep:
    """One optimizer step: the loss, the parallelism's forward/backward, the spike check."""
    # Compiling the loss's chunks pays on GPUs; on CPU it would only add compile time.
    loss_fn = build_loss(
        cfg.training.loss,
        cfg.training.loss_chunk_size,
        z_loss_weight=cfg.training.z_loss_weight,
        compile_chunks=cfg.compile.enable and device.type == "cuda",
        vocab_parallel_group=parallel_dims.loss_parallel_group,
    )
    return TrainStep(
        model,
        optimizer,
        scheduler,
        loader,
        forward_backward=build_forward_backward(
            model, loss_fn, cfg, device=device, parallel_dims=parallel_dims, loader=loader
        ),
        metrics=metrics,
        dp_group=parallel_dims.dp_mesh.get_group(),
        device=device,
        max_norm=cfg.training.max_norm,
        pp=parallel_dims.pp,
        hooks=step_hooks(cfg, model, device, parallel_dims, guard, checkpointer),
    )


def step_hooks(cfg: JobConfig, model, device, parallel_dims, guard, checkpointer) -> list:
    """The step's duties around its optimizer step, in order (trainer/optim/step_hooks.py):
    the spike check's veto, the MTP loss weight of the step, the experts' balancing bias,
    QK-clip. The schedules (MTP loss weight, bias update speed: functions of the step, so a
    resume continues them exactly) are said in one startup line each."""
    m, moe = cfg.model, cfg.moe
    hooks = []
    if cfg.training.on_spike != "log":
        dp = parallel_dims.dp_mesh.size()
        hooks.append(SpikeVeto(spike_check(guard, checkpointer, device, dp)))
    if m.mtp_loss_weight_until_step:
        hooks.append(MTPWeight(m.mtp_weight_at))
        log0(
            f"MTP loss weight {m.mtp_loss_weight} up to step {m.mtp_loss_weight_until_step}, "
            f"then {m.mtp_loss_weight_later} (loss_metrics/mtp_loss_weight)"
        )
    scheduled = moe.balance_coeff_at if moe.load_balance_coeff_until_step else None
    if scheduled is not None:
        log0(
            f"expert bias update speed {moe.load_balance_coeff} up to step "
            f"{moe.load_balance_coeff_until_step}, then 0 (moe/load_balance_coeff)"
        )
    hooks.append(
        ExpertBalance(
            n_layers=model.args.n_blocks,
            coeff=moe.load_balance_coeff,
            device=device,
            moe_ids=model.args.moe_layer_ids,
            coeff_at=scheduled,
        )
    )
    qk_clip = build_qk_clip(model, cfg.optimizer, log=log0)
    return hooks + ([qk_clip] if qk_clip is not None else [])


def main(argv: list[str]) -> int:
    """Entry point: user errors are one line on rank 0 and exit code 2; bugs keep tracebacks."""
    code = 1  # an unexpected exception: no final barrier (a peer may be gone)
    try:
        filter_output()
        train(load_config(argv))
        code = 0
    except OutOfMemory as e:  # this rank's alone: printed by the first rank to report one
        if claim_report():
            print(e.one_line(), file=sys.stderr, flush=True)
        code = e.exit_code
    except UserError as e:
        if reports_user_error(e):
            print(e.one_line(), file=sys.stderr, flush=True)
        code = e.exit_code
    except Preempted as e:
        log0(str(e))
        code = e.exit_code
    except Exception as e:  # a peer that ran out of memory, hung or died has been reported
        code = (
            OUT_OF_MEMORY_EXIT_CODE if peer_ran_out_of_memory() else heartbeat.collective_failure(e)
        )
        if code is None:
            heartbeat.record_crash(e)  # MAX_RESTARTS stops repeating the same one
            raise
    finally:
        if dist.is_initialized() and code not in (OUT_OF_MEMORY_EXIT_CODE, HANG_EXIT_CODE):
            if code in (0, PREEMPTED_EXIT_CODE):
                dist.barrier()
            dist.destroy_process_group()
        lease.release_held()
    return code


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # A bare interpreter exit can abort in gloo's worker threads ("terminate called without
    # an active exception"); skip the interpreter teardown once everything is flushed.
    os._exit(rc)
