"""The checks a launch passes before any process starts, beyond the config itself.

Run by `python -m trainer.config --check` (the SLURM script, once per node) and inside the
launcher for run_train.sh (`python -m trainer.launch --check ...`, one interpreter instead of
two). They refuse a dump folder that a live run holds (trainer/checkpoint/lease.py), so a
second launch stops before any process starts, a LOG_RANK that names no rank of the launch,
and CPU ranks whose memory plan exceeds the node's RAM; and they warn, in one line, when GPU
ranks with gradient sync 'last' would not fit where 'every' would.

Each check is `check(cfg, world_size, ranks_per_node or None)` and raises a UserError.
"""

from __future__ import annotations

import os
import sys

from trainer.checkpoint.lease import check_free
from trainer.device import gpu_memory_gib, visible_gpus
from trainer.distributed import log_ranks
from trainer.plan.host import usable_ram_gib
from trainer.plan.memory import accumulation_sync_note, check_cpu_ram


def lease_is_free(cfg, world_size: int, ranks: int | None) -> None:
    check_free(cfg.job.dump_folder, cfg.job.lease_timeout_seconds)


def log_rank(cfg, world_size: int, ranks: int | None) -> None:
    log_ranks(os.environ.get("LOG_RANK", ""), world_size)


def fits_host_ram(cfg, world_size: int, ranks: int | None) -> None:
    """CPU ranks keep everything in host memory: refuse a plan beyond this node's RAM."""
    if ranks is None:
        return
    on_cpu = cfg.training.device == "cpu" or (
        cfg.training.device == "auto" and visible_gpus()[0] == 0
    )
    if on_cpu:
        check_cpu_ram(cfg, world_size, ranks, usable_ram_gib())


def warn_accumulation_sync(cfg, world_size: int, ranks: int | None) -> None:
    """GPU ranks: one warning line when gradient sync 'last' would not fit and 'every' would
    (trainer.plan.memory.accumulation_sync_note). A warning, not an error: the plan is an
    estimate, and the user may know better."""
    if cfg.training.device == "cpu" or visible_gpus()[0] == 0:
        return
    mem_gib = gpu_memory_gib()
    note = accumulation_sync_note(cfg, world_size, mem_gib) if mem_gib else None
    if note:
        print(note, file=sys.stderr, flush=True)


LAUNCH_CHECKS = (lease_is_free, log_rank, fits_host_ram, warn_accumulation_sync)
