"""A real `run_train.sh` debug run on 2 ranks, judged by its TensorBoard events and console.

One run serves every check (it is the slow part): every tag for the device is there at the
logged steps, finite; the loss is the mean of the per-rank losses (printed by the
TRAINER_DEBUG_RANK_LOSS hook); MFU, TFLOPS and throughput agree with the FLOPs/token the run
announced and the configured peak.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.helpers import TINY, run_train, scalars

STEPS, LOG_FREQ, PEAK = 5, 2, 0.5
LOGGED = [1, 2, 4, 5]  # the first step, every log_freq-th, and the last
TAGS = [
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "lr",
    "n_tokens_seen",
    "throughput(tps)",
    "tflops",
    "mfu(%)",
    "time_metrics/end_to_end(s)",
    "time_metrics/data_loading(s)",
    "time_metrics/data_loading(%)",
]
CUDA_TAGS = [
    "memory/max_active(GiB)",
    "memory/max_active(%)",
    "memory/max_reserved(GiB)",
    "memory/max_reserved(%)",
    "memory/num_alloc_retries",
    "memory/num_ooms",
]
CPU_TAGS = ["memory/max_rss(GiB)"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("metrics_e2e")
    proc = run_train(
        dump,
        *TINY,
        "--training.steps",
        str(STEPS),
        "--metrics.log_freq",
        str(LOG_FREQ),
        "--metrics.peak_tflops",
        str(PEAK),
        "--checkpoint.enable",
        "false",
        log_rank="0,1",
        env={"TRAINER_DEBUG_RANK_LOSS": "1"},
    )
    return dump, proc.stdout


def test_every_tag_finite_at_the_logged_steps(run):
    dump, _ = run
    tags = TAGS + CPU_TAGS  # the run is on CPU ranks (run_train's default device), GPU or not
    for tag in tags:
        values = scalars(dump, tag)
        assert sorted(values) == LOGGED, (tag, values)
        assert all(math.isfinite(v) for v in values.values()), (tag, values)
    assert 0 <= min(scalars(dump, "time_metrics/data_loading(%)").values())
    assert max(scalars(dump, "time_metrics/data_loading(%)").values()) <= 100


def rank_losses(stdout: str) -> dict[int, dict[int, float]]:
    """{step: {rank: local_loss}} from the `rank R step S local_loss X` debug lines."""
    out: dict[int, dict[int, float]] = {}
    for rank, step, loss in re.findall(r"rank (\d+) step (\d+) local_loss (\S+)", stdout):
        out.setdefault(int(step), {})[int(rank)] = float(loss)
    return out


def test_global_avg_loss_is_the_mean_of_rank_losses(run):
    dump, stdout = run
    per_rank = rank_losses(stdout)
    assert sorted(per_rank) == LOGGED, (
        "no per-rank loss lines: train.py must pass local_loss= to MetricsProcessor.log"
    )
    avg = scalars(dump, "loss_metrics/global_avg_loss")
    mx = scalars(dump, "loss_metrics/global_max_loss")
    for step, losses in per_rank.items():
        assert sorted(losses) == [0, 1]
        assert losses[0] != losses[1]  # different data per rank, else the check is vacuous
        assert avg[step] == pytest.approx(sum(losses.values()) / 2, rel=1e-6)
        assert mx[step] == pytest.approx(max(losses.values()), rel=1e-6)


def test_mfu_tflops_and_throughput_agree(run):
    dump, stdout = run
    fpt = float(re.search(r"FLOPs/token: (\S+)", stdout).group(1))  # as announced, 4 digits
    assert f"MFU peak: {PEAK:g} TFLOPS" in stdout and "peak_tflops" in stdout
    tps, tflops, mfu = (scalars(dump, t) for t in ("throughput(tps)", "tflops", "mfu(%)"))
    for step in LOGGED:
        assert tflops[step] == pytest.approx(fpt * tps[step] / 1e12, rel=1e-3)
        assert mfu[step] == pytest.approx(100 * tflops[step] / PEAK, rel=1e-5)


def test_console_has_one_line_per_logged_step(run):
    _, stdout = run
    lines = re.findall(r"^step:\s+(\d+)\s+loss:", stdout, re.M)
    assert [int(s) for s in lines] == LOGGED
    assert "\033[" not in stdout  # captured output is not a terminal: no color codes
    for first_line in ("model: ", "FLOPs/token: ", "mesh: ", "gradient accumulation steps: "):
        assert first_line in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_run_uses_nccl_bf16_cuda_memory_and_the_device_table(tmp_path):
    """The CUDA path for real: nccl, auto = bf16, the allocator's memory tags, and MFU against
    the device table's peak (no peak_tflops given)."""
    proc = run_train(
        tmp_path,
        *TINY[2:],
        "--training.mixed_precision_param",
        "auto",
        "--training.steps",
        "3",
        "--checkpoint.enable",
        "false",
        nproc=1,
        device="cuda",
    )
    assert "device: cuda (nccl" in proc.stdout
    assert "compute dtype: bfloat16 (auto: CUDA)" in proc.stdout
    for tag in TAGS + CUDA_TAGS:
        if tag == "mfu(%)" and "from the device table" not in proc.stdout:
            continue  # a GPU missing from the table: MFU is not reported
        values = scalars(tmp_path, tag)
        assert sorted(values) == [1, 2, 3], (tag, values)
        assert all(math.isfinite(v) for v in values.values()), (tag, values)
    assert 0 < scalars(tmp_path, "memory/max_active(GiB)")[3]
