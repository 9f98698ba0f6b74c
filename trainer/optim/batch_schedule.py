"""The global batch size of every step: constant, or a ramp from a smaller start (GPT-3,
Megatron's `rampup_batch_size`) that grows in multiples of local_batch_size x dp size.

With `training.rampup_batch_start = B0 > 0`, target B = `global_batch_size` and m =
local_batch_size x dp size (every global batch is a whole number of microbatches per rank):

    progress(s) = (s - 1) / rampup_steps                  by steps (s = 1, 2, ...)
                = tokens trained before step s / rampup_tokens    by tokens
    batch(s)    = B0 + m * floor((B - B0) * min(1, progress) / m)

so step 1 trains on B0 sequences, the batch grows by whole multiples of m and is B from
progress 1 on. The microbatch stays local_batch_size (only the number of accumulation steps
grows), so the memory per rank is that of the full batch (trainer.plan.memory needs nothing else).
A token ramp depends only on the samples consumed, a step ramp only on the step: both are
recomputed on resume, so the samples of every step are those of an uninterrupted run.
Torch-free: the config check uses it.
"""

from __future__ import annotations

from trainer.errors import ConfigError


def check_ramp(training, per_pass: int, target: int) -> None:
    """Config errors of a ramp on this world size (per_pass = local_batch_size x dp size)."""
    start = training.rampup_batch_start
    if start == 0:
        if training.rampup_steps or training.rampup_tokens:
            raise ConfigError(
                "training.rampup_steps / rampup_tokens set without "
                "training.rampup_batch_start; set the ramp's first global batch"
            )
        return
    if bool(training.rampup_steps) == bool(training.rampup_tokens):
        raise ConfigError(
            "training.rampup_batch_start needs exactly one of "
            "training.rampup_steps or training.rampup_tokens (> 0)"
        )
    if start % per_pass or start > target:
        raise ConfigError(
            f"training.rampup_batch_start = {start} must be a multiple of local_batch_size x "
            f"dp size = {per_pass} and at most global_batch_size = {target}; valid: "
            f"{', '.join(str(b) for b in range(per_pass, target + 1, per_pass)[:8])}"
            f"{', ...' if target // per_pass > 8 else ''}"
        )


def batch_at(training, step: int, consumed_samples: int, per_pass: int, target: int) -> int:
    """Global batch (sequences) of 1-based `step`, given the samples consumed before it."""
    start = training.rampup_batch_start
    if start == 0 or start >= target:
        return target
    if training.rampup_steps:
        progress = (step - 1) / training.rampup_steps
    else:
        progress = consumed_samples * training.seq_len / training.rampup_tokens
    grown = int((target - start) * min(1.0, progress)) // per_pass * per_pass
    return start + grown


def next_batch(cfg, loader, step: int) -> int:
    """Set the loader's global batch for `step` (a batch-size ramp,
    trainer/optim/batch_schedule.py); returns its microbatches per rank."""
    training = cfg.training
    if training.rampup_batch_start:
        per_pass = training.local_batch_size * loader.dp_size
        loader.set_global_batch_size(
            batch_at(training, step, loader.consumed, per_pass, loader.target_global_batch_size)
        )
    return loader.accum_steps


def describe_ramp(training, loader) -> str:
    over = (
        f"{training.rampup_steps} steps"
        if training.rampup_steps
        else f"{training.rampup_tokens:,} tokens"
    )
    return (
        f"batch ramp: global batch {training.rampup_batch_start} -> "
        f"{loader.target_global_batch_size} sequences over {over}, in steps of "
        f"{training.local_batch_size * loader.dp_size} (trainer/optim/batch_schedule.py)"
    )
