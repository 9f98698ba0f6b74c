"""The largest local batch that fits, by a measured step rather than the plan alone.

The plan (trainer/plan/memory.py) models eager PyTorch: every activation autograd saves. A
compiled step saves less (inductor recomputes cheap pointwise ops and fuses their
intermediates), so on a GPU the plan's peak is ~29% above a compiled 1B step's, and the batch
it calls the largest that fits is smaller than what does. After the second step (compile and
the optimizer's state allocation done), the loop holds this rank's measured peak against the
plan at the same batch: the plan's batch-independent bytes (weights, gradients, optimizer
state, buffers) are exact, so the measured peak less those, over the plan's batch-dependent
bytes, is the share of the plan's activations this run really keeps. Scaling the plan of
every batch by that share gives the largest local batch whose peak fits the device.
"""

from __future__ import annotations

import dataclasses

from trainer.config.job import JobConfig
from trainer.plan.memory import GIB, device_need, largest_local_batch, memory_plan


def _with_batch(cfg: JobConfig, batch: int) -> JobConfig:
    return dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, local_batch_size=batch)
    )


def split(cfg: JobConfig, world_size: int) -> tuple[float, float]:
    """(batch-independent bytes, bytes per sample of the local batch) of the plan's peak, from
    the plan at the run's batch and one sample more."""
    b = cfg.training.local_batch_size
    at_b = memory_plan(cfg, world_size)["total"]
    per_sample = memory_plan(_with_batch(cfg, b + 1), world_size)["total"] - at_b
    return at_b - per_sample * b, float(per_sample)


def measured_fit(cfg: JobConfig, world_size: int, peak_bytes: int, device_gib: float) -> dict:
    """What the measured `peak_bytes` at the run's local batch says: the kept share of the
    plan's batch-dependent bytes, the largest local batch that fits `device_gib`, its
    predicted peak, and the plan's own largest."""
    fixed, per_sample = split(cfg, world_size)
    b = cfg.training.local_batch_size
    share = max(peak_bytes - fixed, 0.0) / (per_sample * b) if per_sample else 1.0

    def predicted(total: int) -> int:  # a plan's total, with its batch part scaled
        return int(fixed + share * (total - fixed))

    best = largest_local_batch(
        cfg, world_size, device_gib, need=lambda total: device_need(predicted(total))
    )
    peak_best = predicted(memory_plan(_with_batch(cfg, best), world_size)["total"]) if best else 0
    return {
        "share": share,
        "largest": best,
        "predicted_peak": peak_best,
        "plan_largest": largest_local_batch(cfg, world_size, device_gib),
        "plan_peak": memory_plan(cfg, world_size)["total"],
        "fixed": fixed,
    }


def describe(cfg: JobConfig, step: int, peak_bytes: int, device_gib: float, fit: dict) -> str:
    """One line for the log."""
    b = cfg.training.local_batch_size
    return (
        f"memory: step {step} peaked at {peak_bytes / GIB:.1f} GiB at local_batch_size {b} "
        f"(the plan, eager: {fit['plan_peak'] / GIB:.1f} GiB; this run keeps "
        f"{100 * fit['share']:.0f}% of the plan's activations); by this measure the largest "
        f"local_batch_size that fits {device_gib:.0f} GiB is {fit['largest']} (peak "
        f"~{fit['predicted_peak'] / GIB:.1f} GiB; the plan alone: {fit['plan_largest']})"
    )
