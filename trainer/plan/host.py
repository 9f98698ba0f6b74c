"""The host (CPU RAM) side of the memory plan (trainer/plan/memory.py).

Every rank is a process with its interpreter, torch and the CUDA/NCCL host libraries; with
`parallelism.fsdp_offload = "cpu"` it also holds its shard of the model state in host memory:

- parameters: fp32 shards in pinned memory (FSDP2's CPUOffloadPolicy(pin_memory=True));
- gradients: fp32 shards, copied device-to-host into pinned memory after each reduce-scatter;
- AdamW's two fp32 states (ordinary pageable memory: `zeros_like` does not pin) and the
  step's temporaries (foreach: one fp32 copy of the shard; fused: none), as on the device.

Pinned memory comes from torch's caching host allocator, which rounds every block up to a
power of two and keeps freed blocks cached: each pinned tensor is counted at its rounded
size. Pinned pages cannot be swapped, so host RAM must hold all of it. An async checkpoint
stages the model and optimizer state in host memory too. All ranks of a node share its RAM:
the node needs `ranks per node x` the per-rank total.
"""

from __future__ import annotations

import os

GIB = 2**30
FP32 = 4
# Per rank, without any model state: interpreter, torch, CUDA context (host side), NCCL,
# dataloader. An assumption, not a measurement: runs log memory/max_rss(GiB) to check it.
HOST_PROCESS_GIB = 3.0
# A CPU rank without model state: interpreter, torch, gloo, the data (about 0.5 GiB of RSS for
# the debug model's default run). Low on purpose: the CPU check refuses only what cannot fit.
CPU_PROCESS_GIB = 0.5


def pinned(nbytes: int) -> int:
    """Bytes a pinned allocation of `nbytes` takes: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0


def host_memory(cfg, b: dict[str, int], shard_bytes: list[int]) -> dict[str, int]:
    """Per-rank host bytes by category and their `host_total`, given the device plan `b` and
    the fp32 bytes of rank 0's shard of every parameter."""
    offload = cfg.parallelism.fsdp_offload == "cpu"
    h = {
        "host_parameters": sum(pinned(n) for n in shard_bytes) if offload else 0,
        "host_gradients": sum(pinned(n) for n in shard_bytes) if offload else 0,
        "host_optimizer_state": b["optimizer_state"] if offload else 0,
        "host_optimizer_step_temp": b["optimizer_step_temp"] if offload else 0,
        "host_checkpoint_staging": (
            b["parameters"] + b["optimizer_state"]
            if cfg.checkpoint.enable and cfg.checkpoint.async_mode == "async"
            else 0
        ),
        "host_process": int(HOST_PROCESS_GIB * GIB),
    }
    h["host_total"] = sum(h.values())
    return h


def offload_staging(group_shards: dict[str, int], p: int, r: int) -> int:
    """Device bytes of the offload copies, from each FSDP group's shard elements: the fp32
    host-to-device copy of the group being gathered and the all-gather inputs cast to the
    compute dtype, the prefetched block's inputs, and one group's reduce-scattered gradient
    before its device-to-host copy (a conservative sum: not all live at the same moment)."""
    biggest = max(group_shards.values())
    block = max((n for k, n in group_shards.items() if k.startswith("layers.")), default=0)
    return (FP32 + p + r) * biggest + p * block


def usable_ram_gib() -> float:
    """This machine's RAM as its processes can use it: MemTotal, or the cgroup's limit
    (a container, a SLURM job) where lower."""
    total, _ = host_ram_gib()
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as fh:
                limit = fh.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit) / GIB)
    return total


def host_ram_gib(override: float = 0.0) -> tuple[float, str]:
    """(GiB of host RAM per node, where the figure comes from): `--host-gib`, else this
    machine's MemTotal (right when planning on a node of the cluster itself)."""
    if override:
        return override, "--host-gib"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GIB, (
                        "this machine's /proc/meminfo; pass --host-gib for the training node's"
                    )
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / GIB, "sysconf"


HOST_ROWS = [
    (None, "host memory per rank ({offload})"),
    ("host_parameters", "parameters (fp32 shards, pinned)"),
    ("host_gradients", "gradients (fp32 shards, pinned)"),
    ("host_optimizer_state", "optimizer state (fp32: AdamW 2 + step, Muon 1)"),
    ("host_optimizer_step_temp", "optimizer step temporaries ({impl})"),
    ("host_checkpoint_staging", "async checkpoint staging"),
    ("host_process", f"process (interpreter, torch, CUDA; assumed {HOST_PROCESS_GIB:g} GiB)"),
    ("host_total", "host total per rank"),
]


def host_report(
    h: dict[str, int], ranks_per_node: int, ram_gib: float, source: str
) -> tuple[list[str], bool]:
    """The node's host-memory line and whether it fits."""
    need = ranks_per_node * h["host_total"] / GIB
    fits = need <= ram_gib
    line = (
        f"host: {h['host_total'] / GIB:.2f} GiB per rank x {ranks_per_node} rank(s) per node "
        f"= {need:.2f} GiB of {ram_gib:.1f} GiB RAM ({source}): "
        f"{'fits' if fits else 'DOES NOT FIT'}"
    )
    return [line], fits
