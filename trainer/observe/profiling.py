"""`torch.profiler` traces of chosen steps and, on CUDA, allocator memory snapshots.

Driven by `[profiling]`. The loop wraps its steps and calls `step()` after each one:

    with StepProfiler(cfg, rank=rank, device=device, start_step=step) as prof:
        for step in range(start_step + 1, cfg.training.steps + 1):
            train_one_step()
            prof.step()

Every step `t` with `t % profile_freq == 0` is traced (the step before it is the profiler's
warm-up) into `{dump_folder}/{save_traces_folder}/iteration_{t}/rank{r}_trace.json`: open it in
chrome://tracing or https://ui.perfetto.dev. Steps count from `start_step`, so a resumed run
traces the same step numbers as an uninterrupted one.

With `enable_memory_snapshot` on CUDA, the allocator history is recorded from the start and
dumped at the same steps into `{dump_folder}/{save_memory_snapshot_folder}/iteration_{t}/
rank{r}_memory_snapshot.pickle`, and once more into `iteration_{t}_exit/` when the run dies of
an out-of-memory error, which is when you need it most. Open it at https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from trainer.health.oom import OutOfMemory

# Allocation events kept by the CUDA allocator history; each costs ~a few hundred bytes + stack.
MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    """No-op unless profiling or memory snapshots are enabled; always safe to call `step()`."""

    def __init__(self, cfg, *, rank: int, device: torch.device, start_step: int = 0):
        pc = cfg.profiling
        self.freq = pc.profile_freq
        self.rank = rank
        self.step_num = start_step  # the last finished step
        self.trace_dir = os.path.join(cfg.job.dump_folder, pc.save_traces_folder)
        self.snapshot_dir = os.path.join(cfg.job.dump_folder, pc.save_memory_snapshot_folder)
        self.trace = pc.enable_profiling
        self.snapshot = pc.enable_memory_snapshot and device.type == "cuda"
        if pc.enable_memory_snapshot and not self.snapshot:
            self._say(f"profiling: memory snapshots are CUDA-only; skipped on {device.type}")
        self._start_step = start_step
        self._profiler: profile | None = None
        self._exiting = False

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "StepProfiler":
        if self.trace:
            # Saving only the traced step (not everything since the start) is the point.
            warnings.filterwarnings("ignore", message=".*Profiler clears events at the end")
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(
                activities=activities,
                schedule=self._schedule,
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
            self._profiler.__enter__()
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A step still being recorded at exit is unfinished (or never ran): don't save it.
        self._exiting = True
        if self._profiler is not None:
            self._profiler.__exit__(exc_type, exc, tb)
            self._profiler = None
        if self.snapshot:
            # The loop turns torch.OutOfMemoryError into its one-line OutOfMemory (exit 5)
            # before it gets here: either means the run died of an OOM.
            if exc_type is not None and issubclass(exc_type, (torch.OutOfMemoryError, OutOfMemory)):
                self._dump_snapshot(f"iteration_{self.step_num + 1}_exit")
            torch.cuda.memory._record_memory_history(enabled=None)

    # ------------------------------------------------------------------ per step
    def step(self) -> None:
        """Call after each training step: advances the trace schedule, dumps due snapshots."""
        self.step_num += 1
        if self.snapshot and self.step_num % self.freq == 0:
            self._dump_snapshot(f"iteration_{self.step_num}")
        if self._profiler is not None:
            self._profiler.step()

    def _schedule(self, n: int) -> ProfilerAction:
        """Action for the step the profiler numbers `n` (from 0), i.e. training step n+1+start."""
        t = self._start_step + n + 1
        if t % self.freq == 0:
            return ProfilerAction.RECORD_AND_SAVE
        if (t + 1) % self.freq == 0:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _save_trace(self, prof: profile) -> None:
        if self._exiting:
            return
        folder = os.path.join(self.trace_dir, f"iteration_{self.step_num}")
        os.makedirs(folder, exist_ok=True)
        t0 = time.perf_counter()
        prof.export_chrome_trace(os.path.join(folder, f"rank{self.rank}_trace.json"))
        self._say(
            f"profiling: trace of step {self.step_num} saved to {folder} "
            f"in {time.perf_counter() - t0:.2f}s"
        )

    def _dump_snapshot(self, name: str) -> None:
        folder = os.path.join(self.snapshot_dir, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        self._say(f"profiling: memory snapshot saved to {path}")

    def _say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)
