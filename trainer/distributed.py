"""Small collective helpers the training loop shares: the process group, rank-0 logging,
agreeing on user errors before anyone waits in a collective, reducing the logged losses, the
training timeout, and the per-sample data hashes of TRAINER_DEBUG_DATA_HASHES."""

from __future__ import annotations

import datetime
import hashlib
import os
import sys

import torch
import torch.distributed as dist

from trainer.config.job import OFFLOAD_NEEDS_CUDA
from trainer.device import resolve_device
from trainer.errors import ConfigError, UserError
from trainer.health import faults, restarts
from trainer.health.heartbeat import note_timeout, watch

# Debugging/testing hook: print a hash of every sample each rank trains on, per step.
DEBUG_DATA_ENV = "TRAINER_DEBUG_DATA_HASHES"


def log_ranks(value: str, world_size: int) -> set[int] | None:
    """The ranks LOG_RANK names ("0", "0,1"; empty: every rank, None)."""
    if not value.strip():
        return None
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts) or any(
        int(p) >= world_size for p in parts
    ):
        raise ConfigError(
            f"LOG_RANK = {value!r}: give the ranks whose output to show, separated "
            f"by commas (e.g. 0 or 0,1), each below the world size {world_size}"
        )
    return {int(p) for p in parts}


def log0(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        # One write per line: ranks share the pipe (LOG_RANK=0,1), and print() writes the
        # newline apart, so another rank's line could land inside this one.
        sys.stdout.write(f"{msg}\n")
        sys.stdout.flush()


def agree_on_user_errors(fn, *args, same_result: bool = False, **kwargs):
    """Run a rank-local setup step; if it fails with a user error on any rank, every rank
    raises the first such error (so no rank is left waiting in a collective). With
    `same_result`, ranks that computed different results also stop, with a config error."""
    error, result = None, None
    try:
        result = fn(*args, **kwargs)
    except UserError as e:
        error = e
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(
        outcomes,
        (None if error is None else (type(error), str(error)), result if same_result else None),
    )
    first = next((err for err, _ in outcomes if err is not None), None)
    if first is not None:
        agreed = first[0](first[1])
        agreed.agreed = True  # every rank raises it: rank 0 reports it (reports_user_error)
        raise agreed
    if same_result and any(res != outcomes[0][1] for _, res in outcomes):
        seen = {rank: res for rank, (_, res) in enumerate(outcomes)}
        raise ConfigError(
            f"ranks disagree on {fn.__name__}: {seen}; the dump folder must be "
            "on storage that every node shares"
        )
    return result


# Keys that may differ between the nodes of one run: a path to the same file, a node's cache
LOCAL_KEYS = ("job.config_file", "data.cache_dir")


def check_same_config(cfg) -> None:
    """Every rank runs one config: a node launched with another override (seq_len, steps,
    flavor) would train on, silently or into a gloo abort or a hang. One digest gathered; the
    configs themselves only when they differ: a config error naming the keys, on every rank."""
    mine = {k: v for k, v in cfg.flat().items() if k not in LOCAL_KEYS}
    digest = hashlib.sha256(repr(sorted(mine.items())).encode()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    configs = [None] * dist.get_world_size()
    dist.all_gather_object(configs, mine)
    rank = next(r for r, d in enumerate(digests) if d != digests[0])
    theirs, ours = configs[rank], configs[0]  # a key only one has: another trainer version
    keys = [k for k in sorted(theirs.keys() | ours.keys()) if theirs.get(k) != ours.get(k)]
    error = ConfigError(
        f"the ranks run different configs: rank {rank} has {keys[0]} = "
        f"{theirs.get(keys[0], '(no such key)')} where rank 0 has "
        f"{ours.get(keys[0], '(no such key)')}"
        + (f" (and {', '.join(keys[1:])})" if keys[1:] else "")
        + "; launch every node with the same config file and overrides"
    )
    error.agreed = True  # every rank raises it: rank 0 reports it
    raise error


def reports_user_error(error: UserError) -> bool:
    """Whether this rank prints `error`'s line. One every rank raised alike (a config error
    before the process group, one agreed on above) is rank 0's to print; one raised after the
    process group without agreement (a damaged shard that one rank read mid-run, or a stop
    that every rank decided) is printed by the first rank to raise one, once per attempt."""
    rank = int(os.environ.get("RANK", "0"))
    if not dist.is_initialized() or getattr(error, "agreed", False):
        return rank == 0
    try:
        return dist.distributed_c10d._get_default_store().add("trainer/user_error", 1) == 1
    except Exception:  # the store is gone with the launcher: say it rather than nothing
        return True


def reduce_z_loss(z_loss: torch.Tensor | None, dp_group) -> float | None:
    """The global mean z-loss per token (the ranks' shares summed), or None without one."""
    if z_loss is None:
        return None
    total = z_loss.detach().clone()
    dist.all_reduce(total, group=dp_group)
    return total.item()


def reduce_mean(value: torch.Tensor, dp_group) -> float:
    """The mean over the dp ranks of a per-rank scalar (e.g. MoE's aux losses)."""
    total = value.detach().float().reshape(()).clone()
    dist.all_reduce(total, group=dp_group)
    return total.item() / dist.get_world_size(dp_group)


def reduce_loss(loss_share: torch.Tensor, rank_loss: torch.Tensor, dp_group) -> tuple[float, float]:
    """(the token-weighted global mean, the largest rank mean) over the dp ranks: each rank's
    `loss_share` is its summed loss / the global token count (trainer/step.py), so their sum
    weighs every token alike, however unevenly the ranks' tokens fall (ignored labels,
    documents)."""
    avg = loss_share.detach().float().reshape(()).clone()
    top = rank_loss.detach().float().reshape(()).clone()
    dist.all_reduce(avg, group=dp_group)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=dp_group)
    return avg.item(), top.item()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting: on CUDA a pinned copy sent with
    non_blocking (a pageable copy makes the host wait for the transfer); elsewhere `.to`."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def set_collective_timeout(seconds: int) -> None:
    """Apply the training timeout to every process group (the default one and the mesh's),
    and arm the heartbeat's own watch with it (trainer/health/heartbeat.py)."""
    watch(seconds)
    seconds = faults.armed().collective_timeout_s or seconds  # a testing hook
    timeout = datetime.timedelta(seconds=seconds)
    note_timeout(seconds)  # named in a hang's report
    for group in list(dist.distributed_c10d._world.pg_names):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def init_distributed(cfg) -> torch.device:
    """nccl on cuda:LOCAL_RANK, gloo on CPU (per `training.device`); seeds every RNG."""
    device = resolve_device(cfg.training.device)
    if cfg.parallelism.fsdp_offload == "cpu" and device.type != "cuda":
        raise ConfigError(OFFLOAD_NEEDS_CUDA.format(where=f"this rank computes on {device}"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if cfg.parallelism.fsdp_offload == "cpu":  # clipping reduces the CPU-resident grads' norm
        backend = "cuda:nccl,cpu:gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.comm.init_timeout_seconds)
    if "RANK" not in os.environ:  # plain `python -m trainer.train`: a world of one
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    store = restarts.attempt_store(timeout)  # under torchrun: this attempt's own keys
    world = (
        {}
        if store is None
        else dict(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    )
    dist.init_process_group(backend, timeout=timeout, store=store, **world)
    torch.manual_seed(cfg.job.seed)
    return device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_sample_hashes(batches, dp_group, ids: list[str]) -> None:
    """One line per rank and step: its dp rank and a short hash of each sample, in order; and
    where each comes from when the loader knows (a blend: source/epoch/window, a second line)."""
    hashes = [
        hashlib.sha1(torch.cat([x[i], y[i, -1:]]).numpy().tobytes()).hexdigest()[:12]
        for x, y in batches
        for i in range(x.shape[0])
    ]
    rank = dist.get_rank(dp_group)
    lines = f"data dp_rank {rank} samples {','.join(hashes)}\n"
    if any(ids):  # a line of its own: the samples line keeps its format
        lines += f"data dp_rank {rank} sources {','.join(ids)}\n"
    sys.stdout.write(lines)
    sys.stdout.flush()
