"""A CUDA out-of-memory in a training step: one line and exit code 5, not a traceback per rank.

    training error: CUDA out of memory at step 2 on rank 0 (peak 68.7 GiB allocated, 70.1 GiB
    reserved of 79.1 GiB); the memory plan fits local_batch_size <= 6 here (now 8): python -m
    trainer.plan.memory --config configs/llama3_1b.toml --ngpu 1 --gpu-mem-gib 79.1 ...

An OOM is rank-local: the rank that hits it may be mid-backward while its peers wait for it in a
collective, so it cannot agree with them the way other errors do (train.agree_on_user_errors).
Instead the first rank to fail claims the report in the rendezvous store (an atomic counter:
when every rank runs out of memory, one line is still printed once), prints the line and exits
without tearing down the process group (which could wait on the peers). Its peers' next
collective then fails (gloo: at once, as the connections close); such a peer finds the claim in
the store and exits with the same code, silently. On nccl a peer can stay blocked inside the
collective: torchrun stops the workers once one has exited (SIGTERM, then SIGKILL after 30 s).
"""

from __future__ import annotations

import os
import shlex

import torch
import torch.distributed as dist

from trainer.errors import OUT_OF_MEMORY_EXIT_CODE as OOM_EXIT_CODE
from trainer.errors import TrainingError
from trainer.health import faults

_CLAIM_KEY = "trainer/out_of_memory"
GIB = 2**30


class OutOfMemory(TrainingError):
    exit_code = OOM_EXIT_CODE


def out_of_memory(cfg, step: int, device: torch.device) -> OutOfMemory:
    """The one-line error for an OOM at `step`: the peak and what the memory plan advises."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        peak = (
            f"peak {torch.cuda.max_memory_allocated(device) / GIB:.1f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved(device) / GIB:.1f} GiB reserved of "
            f"{total:.1f} GiB"
        )
    else:
        total = faults.armed().device_gib  # an injected OOM's stand-in (health/faults.py)
        peak = f"no peak on {device.type}; a {total:g} GiB device assumed"
    return OutOfMemory(
        f"CUDA out of memory at step {step} on rank {rank} ({peak}); {plan_advice(cfg, total)}"
    )


def plan_advice(cfg, mem_gib: float) -> str:
    """What trainer.plan.memory says fits `mem_gib`, and the command that shows why."""
    from trainer.plan.memory import largest_local_batch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    nnodes = max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    # The run's effective config (saved at startup, CLI overrides included), so the command
    # plans the model that ran out of memory.
    saved = os.path.join(cfg.job.dump_folder, "config.toml")
    config = saved if os.path.isfile(saved) else (cfg.job.config_file or "...")
    cmd = (
        f"python -m trainer.plan --config {shlex.quote(config)} "
        f"--ngpu {world // nnodes} --nnodes {nnodes} --gpu-mem-gib {mem_gib:g}"
    )
    if not mem_gib:
        return f"see {cmd}"
    best = largest_local_batch(cfg, world, mem_gib)
    now = cfg.training.local_batch_size
    if best == 0:
        return f"the memory plan fits no local_batch_size on this device; see {cmd}"
    if best >= now:
        return (
            f"the memory plan expects local_batch_size {now} to fit (by "
            f"{cmd}); try activation_checkpoint.mode = 'selective' or 'full'"
        )
    return f"the memory plan fits local_batch_size <= {best} here (now {now}); see {cmd}"


def claim_report() -> bool:
    """True on the first rank to report an OOM (every rank can hit one at the same step)."""
    store = _store()
    return store is None or store.add(_CLAIM_KEY, 1) == 1


def peer_ran_out_of_memory() -> bool:
    """Whether a peer has reported an OOM (then this rank's failed collective is its echo)."""
    store = _store()
    try:
        return store is not None and store.check([_CLAIM_KEY])
    except Exception:  # the store's host is gone too: nothing to learn from it
        return False


def _store():
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()
