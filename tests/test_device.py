"""Device choice and compute dtype: the same commands on any machine a user has.

The rank count and the GPU check happen before any process starts (run_train.sh asks
`trainer.config.job --check`); a machine's GPUs are seen through CUDA_VISIBLE_DEVICES or
`nvidia-smi`, so a stand-in `nvidia-smi` on PATH shows what a GPU machine would get here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import REPO, TINY, losses, run_train, stopped_after_save, subprocess_env
from trainer.device import (
    Precision,
    cpu_native_bf16,
    local_ranks,
    resolve_compute_dtype,
    visible_gpus,
)
from trainer.errors import ConfigError

NATIVE_BF16, ISA = cpu_native_bf16()


@pytest.mark.parametrize(
    "device,ngpu,gpus,ranks",
    [
        ("auto", None, 0, 2),
        ("auto", "", 0, 2),
        ("auto", "3", 0, 3),  # CPU: 2 unless NGPU
        ("auto", None, 8, 8),
        ("auto", "4", 8, 4),
        ("cuda", None, 2, 2),  # GPU: all, or NGPU
        ("cpu", None, 8, 2),
        ("cpu", "4", 1, 4),  # CPU ranks on a GPU box
    ],
)
def test_ranks_per_node(device, ngpu, gpus, ranks):
    assert local_ranks(device, ngpu, gpus, "seen") == ranks


@pytest.mark.parametrize(
    "device,ngpu,gpus,message",
    [
        (
            "auto",
            "4",
            1,
            "NGPU=4 ranks per node but only 1 GPU visible (seen); set NGPU <= 1, or "
            "--training.device cpu to run 4 CPU ranks",
        ),
        ("cuda", "3", 2, "NGPU=3 ranks per node but only 2 GPUs visible (seen)"),
        ("cuda", None, 0, "training.device = 'cuda' but no GPU is visible (seen)"),
        ("auto", "0", 1, "NGPU='0' is not a positive integer"),
        ("cpu", "two", 0, "NGPU='two' is not a positive integer"),
    ],
)
def test_impossible_rank_counts(device, ngpu, gpus, message):
    with pytest.raises(ConfigError) as err:
        local_ranks(device, ngpu, gpus, "seen")
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    "value,count",
    [("0,1", 2), ("", 0), ("-1", 0), ("0,-1,2", 1), ("GPU-8c1c,GPU-77ee", 2), ("3", 1)],
)
def test_cuda_visible_devices_decides(monkeypatch, value, count):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert visible_gpus() == (count, f"CUDA_VISIBLE_DEVICES={value!r}")


def fake_gpu_machine(tmp_path, gpus: int) -> dict:
    """An environment whose PATH has an `nvidia-smi` listing `gpus` H100s (and no
    CUDA_VISIBLE_DEVICES), as on a GPU machine; torch itself still sees no GPU here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    lines = "".join(
        f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})"\n' for i in range(gpus)
    )
    smi.write_text(f"#!/bin/sh\n{lines}")
    smi.chmod(0o755)
    return {"PATH": f"{bin_dir}:{subprocess_env()['PATH']}", "CUDA_VISIBLE_DEVICES": None}


def test_nvidia_smi_counts_the_machines_gpus(tmp_path, monkeypatch):
    env = fake_gpu_machine(tmp_path, 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", env["PATH"])
    assert visible_gpus() == (2, "nvidia-smi")


def run_sh(tmp_path, *overrides, env: dict, nproc=None, device=None, timeout=60):
    """run_train.sh as a user runs it: NGPU and the device as given (unset by default)."""
    return run_train(
        tmp_path / "out",
        *overrides,
        nproc=nproc,
        device=device,
        env=env,
        check=False,
        timeout=timeout,
    )


def one_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_more_ranks_than_gpus_is_one_config_error(tmp_path):
    """NGPU=4 on a 1-GPU machine: one line naming NGPU and the GPUs seen, before any rank."""
    t0 = time.monotonic()
    proc = run_sh(tmp_path, env=fake_gpu_machine(tmp_path, 1), nproc=4)
    assert proc.returncode == 2
    assert one_line(proc) == (
        "config error: NGPU=4 ranks per node but only 1 GPU visible "
        "(nvidia-smi); set NGPU <= 1, or --training.device cpu to run 4 "
        "CPU ranks"
    )
    # before any rank: no rank's error, and not the minutes 4 ranks' imports and startup
    # would take on an oversubscribed 2-core machine (one fresh import here: a few seconds)
    assert time.monotonic() - t0 < 45 and "invalid device ordinal" not in proc.stderr


def test_cuda_without_a_gpu_is_one_config_error(tmp_path):
    proc = run_sh(tmp_path, "--training.device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert one_line(proc).startswith(
        "config error: training.device = 'cuda' but no GPU is visible (CUDA_VISIBLE_DEVICES='')"
    )


def test_ranks_check_the_device_too(tmp_path):
    """Started without run_train.sh's check, a rank still refuses in one line: no CUDA here, or
    more ranks on the node than GPUs on a GPU machine."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "--training.device",
            "cuda",
            *TINY[2:],
            "--job.dump_folder",
            str(tmp_path),
        ],
        env=subprocess_env({"LOCAL_WORLD_SIZE": "99"}),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2
    line = one_line(proc)
    if torch.cuda.is_available():
        assert line.startswith("config error: 99 ranks on this node but torch sees "), line
    else:
        assert line.startswith("config error: training.device = 'cuda' but torch "), line
        assert "sees no CUDA device" in line


# In the launcher (and so in the ranks it forks): every CUDA query torch makes, with the
# CUDA_VISIBLE_DEVICES it was made under, one line each in $CUDA_PROBE_FILE.
CUDA_PROBE = """
import os
if "trainer.launch" in open("/proc/self/cmdline", "rb").read().decode(errors="replace"):
    import torch

    def _probe(name, fn):
        def probed(*args, **kwargs):
            with open(os.environ["CUDA_PROBE_FILE"], "a") as f:
                f.write(f"{os.getpid()} {name} {os.environ.get('CUDA_VISIBLE_DEVICES')!r}\\n")
            return fn(*args, **kwargs)
        return probed

    for _name in ("is_available", "device_count"):
        setattr(torch.cuda, _name, _probe(_name, getattr(torch.cuda, _name)))
"""


def test_cpu_ranks_on_a_gpu_machine_and_the_auto_dtype(tmp_path):
    """`--training.device cpu` with NGPU unset: 2 CPU ranks (gloo) even where GPUs are seen.
    `mixed_precision_param = "auto"` says what it chose and why; the saved config keeps auto.
    No CUDA query is made with a GPU visible, neither by the launcher (torchrun asks
    `torch.cuda.is_available()`, which initialises the driver, and CPU ranks forked after that
    fail at their first CUDA query: seen on an H100) nor by the ranks."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(CUDA_PROBE)
    env = {
        **fake_gpu_machine(tmp_path, 1),
        "CUDA_PROBE_FILE": str(tmp_path / "cuda_queries"),
        "PYTHONPATH": f"{probe}:{REPO}",
    }
    proc = run_sh(
        tmp_path,
        *TINY,
        "--training.mixed_precision_param",
        "auto",
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "false",
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    queries = (tmp_path / "cuda_queries").read_text().splitlines()
    assert queries and all(q.endswith(" ''") for q in queries), queries
    assert len({q.split()[0] for q in queries}) >= 2, queries  # the launcher's and the ranks'
    assert "mesh: FSDP mesh (dp_replicate=1, dp_shard=2)" in proc.stdout
    assert "device: cpu (gloo)" in proc.stdout
    want = (
        "compute dtype: bfloat16 (auto: this CPU computes bf16 natively"
        if NATIVE_BF16
        else "compute dtype: float32 (auto: this CPU has no native bf16"
    )
    assert want in proc.stdout, proc.stdout
    assert 'mixed_precision_param = "auto"' in (tmp_path / "out" / "config.toml").read_text()
    assert "warning:" not in proc.stderr


# --------------------------------------------------------------------------- compute dtype


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_only_where_native(monkeypatch, native):
    monkeypatch.setattr("trainer.device.cpu_native_bf16", lambda: (native, "ISA"))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    got = resolve_compute_dtype("auto", "float32", cpu)
    assert got.param == ("bfloat16" if native else "float32") and not got.warning
    assert resolve_compute_dtype("auto", "float32", cuda) == Precision(
        "bfloat16", "float32", "auto: CUDA"
    )
    explicit = resolve_compute_dtype("bfloat16", "float32", cpu)
    assert explicit.param == "bfloat16"  # an explicit choice is honoured, never changed
    assert bool(explicit.warning) is not native
    assert resolve_compute_dtype("float32", "float32", cpu).param == "float32"
    # Ranks agree: one rank without native bf16 makes every rank compute in float32.
    assert resolve_compute_dtype("auto", "float32", cpu, lambda n: False).param == "float32"


# bf16 runs are kept tiny: on CPUs without native bf16 (AVX2) each matmul is emulated.
BF16 = [
    *TINY,
    "--training.mixed_precision_param",
    "bfloat16",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "1",
    "--training.global_batch_size",
    "4",
    "--lr_scheduler.min_lr_factor",
    "1.0",
]


def test_bf16_layout_parity_accumulation_and_resume(tmp_path):
    """The guarantees of the fp32 tests hold in bf16 too. 1 process (4 microbatches), FSDP 2
    (2 microbatches) and HSDP 2x2 (1 microbatch) give the same step-1 loss, then stay close
    (reduction order differs); a resume is bitwise. The warning line: emulated bf16 only."""
    steps = ["--training.steps", "2"]
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]
    runs = {
        "single": run_train(tmp_path / "single", *BF16, *steps, nproc=1),
        "fsdp2": run_train(tmp_path / "fsdp2", *BF16, *ckpt, *steps),
        "hsdp": run_train(
            tmp_path / "hsdp",
            *BF16,
            *steps,
            "--parallelism.data_parallel_replicate_degree",
            "2",
            nproc=4,
        ),
    }
    assert "gradient accumulation steps: 4" in runs["single"].stdout
    assert "gradient accumulation steps: 1" in runs["hsdp"].stdout
    for proc in runs.values():
        assert "compute dtype: bfloat16 (set in the config)" in proc.stdout
        warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
        assert len(warned) == (0 if NATIVE_BF16 else 1), proc.stderr
    ref = losses(tmp_path / "single")
    for name in ("fsdp2", "hsdp"):
        got = losses(tmp_path / name)
        assert got[1] == ref[1], (name, got, ref)
        assert got[2] == pytest.approx(ref[2], rel=1e-3), (name, got, ref)

    # Resume the FSDP run as if it had stopped after saving step 1: step 2 again, bitwise.
    resumed = stopped_after_save(tmp_path / "fsdp2", tmp_path / "resumed", 2)
    out = run_train(resumed, *BF16, *ckpt, *steps).stdout
    assert re.search(r"resumed from \S*step-1 \(step 1\)", out), out
    assert losses(resumed) == {2: losses(tmp_path / "fsdp2")[2]}  # bitwise


@pytest.mark.parametrize(
    "cap, native_possible",
    [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_BF16", True), ("", True)],
)
def test_a_onednn_isa_cap_below_bf16_means_no_native_bf16(monkeypatch, cap, native_possible):
    # oneDNN capped below AVX512_CORE_BF16 emulates bf16 matmuls even where the CPU has it,
    # so "auto" must not pick bf16 there (and the suite can emulate an AVX2-only machine).
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    hardware = cpu_native_bf16()[0]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    native, isa = cpu_native_bf16()
    if not native_possible:
        assert not native and "ONEDNN_MAX_CPU_ISA" in isa
    else:
        assert native == hardware
