"""Where a run computes and in which dtype: `[training] device` and `mixed_precision_param`.

Two moments use this module:

- Before any process starts (the config check: in run_train.sh's launcher, and `python -m
  trainer.config --check` in the SLURM script; no CUDA call, nvidia-smi counts the GPUs, so the
  launcher can still fork CPU ranks): how many ranks this node gets, and whether that many
  fit the GPUs it can see. More ranks than GPUs is a `config error:` naming NGPU and the GPUs
  seen, never an `invalid device ordinal` from a rank.
- In every rank (`resolve_device`, `resolve_compute_dtype`): the torch device, and the compute
  dtype that "auto" stands for. bf16 is chosen only where it is native: on CUDA and on CPUs
  with AVX512-BF16 or AMX (x86) or the BF16 extension (Arm). Elsewhere (e.g. an AVX2-only
  EPYC) bf16 matmuls are emulated, ~30-45x slower than float32, so "auto" picks float32 and
  says why; an explicit "bfloat16" there runs, with one warning line.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

from trainer.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
CPU_RANKS_DEFAULT = 2  # ranks per node when the run is on CPU and NGPU is not set


# --------------------------------------------------------------------------- before launch


def visible_gpus() -> tuple[int, str]:
    """(number of CUDA GPUs this process may use, how that was seen), without importing torch.

    CUDA_VISIBLE_DEVICES decides when it is set (SLURM sets it for the GPUs it allocated);
    otherwise `nvidia-smi --list-gpus` counts the GPUs of the machine.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = []
        for item in env.split(","):
            item = item.strip()
            if not item or item.startswith("-"):  # CUDA stops at the first invalid id
                break
            ids.append(item)
        return len(ids), f"CUDA_VISIBLE_DEVICES={env!r}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "no nvidia-smi on PATH"
    return _listed_gpus(smi)


@functools.lru_cache(maxsize=None)
def _listed_gpus(smi: str) -> tuple[int, str]:
    """`nvidia-smi --list-gpus`, once per process and binary: a launch asks up to four times
    (the ranks, the RAM and memory checks, the fork decision)."""
    try:
        out = subprocess.run([smi, "--list-gpus"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return 0, f"nvidia-smi failed: {e}"
    if out.returncode != 0:
        return 0, f"nvidia-smi --list-gpus exited {out.returncode}"
    return sum(ln.startswith("GPU ") for ln in out.stdout.splitlines()), "nvidia-smi"


def gpu_memory_gib() -> float:
    """The first visible GPU's memory in GiB from nvidia-smi (0.0 if it cannot tell), without
    importing torch."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0.0
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return float(out.stdout.split()[0]) / 1024 if out.returncode == 0 else 0.0
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0.0


def local_ranks(device: str, ngpu: str | None, gpus: int, seen: str) -> int:
    """Ranks this node starts: NGPU if given, else every visible GPU, else 2 CPU ranks.

    `device` is `training.device`; `ngpu` the NGPU variable ('' or None when unset). Raises a
    ConfigError when the run would put more ranks on the GPUs than there are.
    """
    if ngpu:
        if not (ngpu.isascii() and ngpu.isdigit() and int(ngpu) >= 1):
            raise ConfigError(f"NGPU={ngpu!r} is not a positive integer (ranks per node)")
        ranks = int(ngpu)
    else:
        ranks = None
    on_gpu = device == "cuda" or (device == "auto" and gpus > 0)
    if not on_gpu:
        return ranks or CPU_RANKS_DEFAULT
    if gpus == 0:
        raise ConfigError(
            f"training.device = 'cuda' but no GPU is visible ({seen}); use "
            "--training.device cpu (or auto) to train on the CPU"
        )
    if ranks is None:
        return gpus
    if ranks > gpus:
        raise ConfigError(
            f"NGPU={ranks} ranks per node but only {gpus} GPU{'s' if gpus > 1 else ''} visible "
            f"({seen}); set NGPU <= {gpus}, or --training.device cpu to run {ranks} CPU ranks"
        )
    return ranks


# --------------------------------------------------------------------------- in the ranks


def resolve_device(setting: str):
    """The torch device of this rank: cuda:LOCAL_RANK or cpu. Every rank checks the same
    things before any process group exists, so a mismatch is one line (rank 0's), not a hang
    or an `invalid device ordinal`."""
    import torch

    has_cuda = torch.cuda.is_available()
    if setting == "cpu" or (setting == "auto" and not has_cuda):
        return torch.device("cpu")
    if not has_cuda:
        raise ConfigError(
            f"training.device = 'cuda' but torch {torch.__version__} sees no CUDA "
            f"device (CUDA build: {torch.version.cuda or 'none, a CPU-only build'})"
            "; use --training.device cpu or auto"
        )
    count = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > count:
        raise ConfigError(
            f"{local_world} ranks on this node but torch sees {count} GPU"
            f"{'s' if count > 1 else ''}; set NGPU <= {count}, or "
            "--training.device cpu for CPU ranks"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


# oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA) that stop below its
# bf16 dot products: under them oneDNN emulates bf16 even on a CPU that has AVX512-BF16.
_ONEDNN_NO_BF16 = {
    "sse41",
    "avx",
    "avx2",
    "avx2_vnni",
    "avx2_vnni_2",
    "avx512_core",
    "avx512_core_vnni",
}


def _onednn_isa_cap() -> str:
    """The ISA cap oneDNN runs under in this process, lower-case ('' = none set)."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA", "")).lower()


def cpu_native_bf16() -> tuple[bool, str]:
    """(does this CPU compute bf16 natively, the instruction set that says so)."""
    import torch

    cap = _onednn_isa_cap()
    if cap in _ONEDNN_NO_BF16:
        return False, f"ONEDNN_MAX_CPU_ISA={cap.upper()}, no AVX512-BF16/AMX for oneDNN"
    checks = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    for name, fn in checks:
        probe = getattr(torch.cpu, fn, None)
        if probe is not None and probe():
            return True, name
    if _arm_bf16():
        return True, "Arm BF16"
    return False, f"{torch.backends.cpu.get_cpu_capability()}, no AVX512-BF16/AMX"


def _arm_bf16() -> bool:
    """aarch64 CPUs list the BF16 extension as 'bf16' in /proc/cpuinfo's Features."""
    if os.uname().machine not in ("aarch64", "arm64"):
        return False
    try:
        with open("/proc/cpuinfo") as fh:
            return any(line.startswith("Features") and "bf16" in line.split() for line in fh)
    except OSError:
        return False


@dataclass(frozen=True)
class Precision:
    """The dtypes a run computes and reduces in, and why."""

    param: str  # "bfloat16" or "float32": the unsharded compute params
    reduce: str  # gradient reduction dtype
    reason: str  # one line for the startup summary
    warning: str = ""  # set when an explicit choice is known to be slow here

    def describe(self) -> str:
        return f"compute dtype: {self.param} ({self.reason}), gradient reduction {self.reduce}"


SLOW_BF16 = "bf16 matmuls are emulated there, ~30x slower than float32"


def resolve_compute_dtype(param: str, reduce: str, device, native_everywhere=None) -> Precision:
    """What `training.mixed_precision_param` means on `device`.

    `native_everywhere(native: bool) -> bool` lets the ranks agree (every rank must compute in
    the same dtype: FSDP all-gathers in it); None = this process alone.
    """
    if device.type == "cuda":
        why = "auto: CUDA" if param == "auto" else "set in the config"
        return Precision("bfloat16" if param == "auto" else param, reduce, why)
    native, isa = cpu_native_bf16()
    if native_everywhere is not None:
        native = native_everywhere(native)
        if not native and cpu_native_bf16()[0]:
            isa = "another rank's CPU has no native bf16"
    if param == "auto":
        if native:
            return Precision("bfloat16", reduce, f"auto: this CPU computes bf16 natively ({isa})")
        return Precision(
            "float32", reduce, f"auto: this CPU has no native bf16 ({isa}); {SLOW_BF16}"
        )
    warning = ""
    if param == "bfloat16" and not native:
        warning = (
            f"warning: training.mixed_precision_param = 'bfloat16' on a CPU without native "
            f"bf16 ({isa}): {SLOW_BF16}; 'auto' would pick float32"
        )
    return Precision(param, reduce, "set in the config", warning)
