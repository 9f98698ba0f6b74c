"""MetricsProcessor: the figures it writes, read back from the real TensorBoard event files.

Time is driven by a fake clock, so throughput, MFU and timings have exact expected values.
"""

from __future__ import annotations

import glob
import math
import os

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trainer.observe.metrics as metrics
from trainer.config.job import JobConfig
from trainer.models.flavors import model_args
from trainer.models.flops import flops_per_token
from trainer.observe.metrics import MetricsProcessor, format_line, memory_metrics, use_color

ARGS = model_args("debugmodel")
SEQ = 256
CPU = torch.device("cpu")
BASE_TAGS = {
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "lr",
    "n_tokens_seen",
    "throughput(tps)",
    "tflops",
    "time_metrics/end_to_end(s)",
    "time_metrics/data_loading(s)",
    "time_metrics/data_loading(%)",
}
CUDA_MEMORY_TAGS = {
    "memory/max_active(GiB)",
    "memory/max_active(%)",
    "memory/max_reserved(GiB)",
    "memory/max_reserved(%)",
    "memory/num_alloc_retries",
    "memory/num_ooms",
    "memory/max_rss(GiB)",  # host memory too: with fsdp_offload the sharded state lives there
}


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(metrics, "_clock", c)
    return c


def make(tmp_path, *, peak=0.0, rank=0, device=CPU, **metric_cfg):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.metrics.peak_tflops = peak
    for k, v in metric_cfg.items():
        setattr(cfg.metrics, k, v)
    mp = MetricsProcessor(
        cfg,
        model_args=ARGS,
        seq_len=SEQ,
        device=device,
        rank=rank,
        parallel_desc="FSDP dp_shard=2",
        accumulation_steps=2,
        num_params=ARGS.num_params(),
    )
    mp.open()
    return mp


def run_steps(mp, clock, *, steps, tokens, step_s, data_s, first_step=1, log=True):
    """`steps` steps of `step_s` seconds each, `data_s` of which load data; then log."""
    for _ in range(steps):
        mp.step_timer()
        with mp.data_timer():
            clock.t += data_s
        mp.count_tokens(tokens)
        clock.t += step_s - data_s
    if log:
        step = first_step + steps - 1
        return mp.log(
            step,
            global_avg_loss=5.0 + step,
            global_max_loss=6.0 + step,
            grad_norm=0.5,
            lr=1e-3,
            tokens_seen=step * tokens,
        )


def events(tmp_path) -> EventAccumulator:
    (run,) = glob.glob(os.path.join(tmp_path, "tb", "*"))
    acc = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def values(acc, tag) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_mfu_is_flops_per_token_times_tps_over_peak(tmp_path, clock):
    mp = make(tmp_path, peak=2.0)
    run_steps(mp, clock, steps=4, tokens=1000, step_s=0.5, data_s=0.1)  # steps 1-4
    run_steps(mp, clock, steps=2, tokens=3000, step_s=2.0, data_s=1.0, first_step=5)  # 5-6
    mp.close()
    acc = events(tmp_path)
    assert set(acc.Tags()["scalars"]) == BASE_TAGS | {"mfu(%)", "memory/max_rss(GiB)"}
    tps, mfu = values(acc, "throughput(tps)"), values(acc, "mfu(%)")
    assert tps == pytest.approx({4: 2000.0, 6: 1500.0}, rel=1e-6)
    fpt = flops_per_token(ARGS, SEQ)
    for step in (4, 6):
        assert mfu[step] == pytest.approx(100 * fpt * tps[step] / 2.0e12, rel=1e-6)
        assert values(acc, "tflops")[step] == pytest.approx(fpt * tps[step] / 1e12, rel=1e-6)
    assert values(acc, "time_metrics/end_to_end(s)") == pytest.approx({4: 0.5, 6: 2.0})
    assert values(acc, "time_metrics/data_loading(s)") == pytest.approx({4: 0.1, 6: 1.0})
    assert values(acc, "time_metrics/data_loading(%)") == pytest.approx({4: 20.0, 6: 50.0})
    assert values(acc, "loss_metrics/global_avg_loss") == {4: 9.0, 6: 11.0}
    assert values(acc, "n_tokens_seen") == {4: 4000.0, 6: 18000.0}


def test_time_between_logs_counts_toward_end_to_end(tmp_path, clock):
    """A checkpoint save after a log step is part of the next interval, as the user sees it."""
    mp = make(tmp_path, enable_tensorboard=False)
    run_steps(mp, clock, steps=1, tokens=100, step_s=1.0, data_s=0.0)
    clock.t += 3.0  # e.g. saving a checkpoint
    m = run_steps(mp, clock, steps=1, tokens=100, step_s=1.0, data_s=0.0, first_step=2)
    assert m["time_metrics/end_to_end(s)"] == pytest.approx(4.0)
    assert m["throughput(tps)"] == pytest.approx(25.0)


def test_no_peak_on_cpu_means_no_mfu(tmp_path, clock, capsys):
    mp = make(tmp_path)
    mp.log_startup()
    startup = capsys.readouterr().out
    assert "none configured: MFU not reported" in startup
    assert "FLOPs/token" in startup and "accumulation steps: 2" in startup
    assert "FSDP dp_shard=2" in startup and "non-embedding" in startup
    m = run_steps(mp, clock, steps=2, tokens=10, step_s=1.0, data_s=0.5)
    mp.close()
    assert "mfu(%)" not in m and "mfu" not in capsys.readouterr().out
    assert set(events(tmp_path).Tags()["scalars"]) == BASE_TAGS | {"memory/max_rss(GiB)"}


def test_configured_peak_is_labelled_on_cpu(tmp_path, capsys):
    make(tmp_path, peak=3.5, enable_tensorboard=False).log_startup()
    assert (
        "3.5 TFLOPS bf16 per device, from the config ([metrics] peak_tflops"
        in capsys.readouterr().out
    )


def test_config_and_hparams_are_recorded(tmp_path, clock):
    mp = make(tmp_path, peak=1.0)
    run_steps(mp, clock, steps=1, tokens=10, step_s=1.0, data_s=0.0)
    mp.close()
    acc = events(tmp_path)
    (text,) = acc.Tensors("config/text_summary")
    toml = text.tensor_proto.string_val[0].decode()
    assert "[metrics]" in toml and "peak_tflops = 1.0" in toml
    hp = acc.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(hp)
    assert b"derived.flops_per_token" in hp["_hparams_/session_start_info"]


def test_only_rank0_writes_and_prints(tmp_path, clock, capsys):
    mp = make(tmp_path, peak=1.0, rank=1)
    mp.log_startup()
    m = run_steps(mp, clock, steps=1, tokens=10, step_s=1.0, data_s=0.0)
    mp.close()
    assert not os.path.exists(tmp_path / "tb") and capsys.readouterr().out == ""
    assert m["throughput(tps)"] == 10.0  # it still measures (and resets) its interval


def test_rank_loss_debug_line(tmp_path, clock, capsys, monkeypatch):
    mp = make(tmp_path, rank=1)
    mp.step_timer()
    mp.log(
        3, global_avg_loss=1, global_max_loss=1, grad_norm=1, lr=1, tokens_seen=1, local_loss=0.1
    )
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("TRAINER_DEBUG_RANK_LOSS", "1")
    mp.log(
        4, global_avg_loss=1, global_max_loss=1, grad_norm=1, lr=1, tokens_seen=1, local_loss=0.1
    )
    assert capsys.readouterr().out == "rank 1 step 4 local_loss 0.1\n"


def test_z_loss_is_its_own_tag_and_console_figure(tmp_path, clock, capsys):
    mp = make(tmp_path, disable_color=True)
    mp.step_timer()
    mp.log(1, global_avg_loss=7.5, global_max_loss=7.5, grad_norm=1, lr=1, tokens_seen=1)
    mp.step_timer()
    m = mp.log(
        2,
        global_avg_loss=7.25,
        global_max_loss=7.5,
        grad_norm=1,
        lr=1,
        tokens_seen=1,
        z_loss=0.0625,
    )
    mp.step_timer()
    mp.log(
        3,
        global_avg_loss=7.0,
        global_max_loss=7.5,
        grad_norm=1,
        lr=1,
        tokens_seen=1,
        mtp_loss=7.125,
    )  # multi-token prediction: its own tag and figure too
    mp.close()
    out = capsys.readouterr().out.splitlines()
    assert "loss:   7.5000 (max 7.5000)  " in out[-3]
    assert "loss:   7.2500 (max 7.5000, z 6.25e-02)  " in out[-2]
    assert "loss:   7.0000 (max 7.5000, mtp 7.1250)  " in out[-1]
    assert m["loss_metrics/z_loss"] == 0.0625 and m["loss_metrics/global_avg_loss"] == 7.25
    assert values(events(tmp_path), "loss_metrics/z_loss") == {2: 0.0625}
    assert values(events(tmp_path), "loss_metrics/mtp_loss") == {3: 7.125}


def test_close_is_idempotent_and_flushes(tmp_path, clock):
    mp = make(tmp_path)
    run_steps(mp, clock, steps=1, tokens=10, step_s=1.0, data_s=0.0)
    mp.close()
    mp.close()
    assert values(events(tmp_path), "grad_norm") == {1: 0.5}
    make(tmp_path / "never_logged").close()


def test_each_launch_gets_its_own_run_folder(tmp_path):
    for _ in range(2):
        make(tmp_path).close()
    assert len(glob.glob(os.path.join(tmp_path, "tb", "*"))) == 2


def fake_cuda(monkeypatch, name="NVIDIA H100 80GB HBM3"):
    """A CUDA device as seen through the torch.cuda calls metrics makes (no GPU here)."""
    stats = {
        "active_bytes.all.peak": 20 * 2**30,
        "reserved_bytes.all.peak": 40 * 2**30,
        "num_alloc_retries": 3,
        "num_ooms": 0,
    }
    resets = []

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(1))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return resets


def test_cuda_memory_tags_and_table_peak(tmp_path, clock, monkeypatch):
    resets = fake_cuda(monkeypatch)
    mp = make(tmp_path, device=torch.device("cuda", 0))
    m = run_steps(mp, clock, steps=2, tokens=5000, step_s=1.0, data_s=0.0)
    mp.close()
    assert resets == [1]  # peaks are per log interval
    assert m["memory/max_active(GiB)"] == 20 and m["memory/max_active(%)"] == 25
    assert m["memory/max_reserved(GiB)"] == 40 and m["memory/max_reserved(%)"] == 50
    assert m["memory/num_alloc_retries"] == 3 and m["memory/num_ooms"] == 0
    assert m["mfu(%)"] == pytest.approx(100 * flops_per_token(ARGS, SEQ) * 5000 / 989.5e12)
    assert set(events(tmp_path).Tags()["scalars"]) == BASE_TAGS | CUDA_MEMORY_TAGS | {"mfu(%)"}


def test_cpu_rss_is_plausible():
    rss = memory_metrics(torch.device("cpu"))["memory/max_rss(GiB)"]
    assert 0.01 < rss < 64 and math.isfinite(rss)


def test_color_policy(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    assert use_color(False, Tty()) and not use_color(True, Tty())
    assert not use_color(False, open(os.devnull, "w"))  # a file or pipe: no escape codes
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert use_color(False, open(os.devnull, "w")) and not use_color(True, Tty())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(False, Tty())


def test_console_line(tmp_path, clock):
    m = run_steps(
        make(tmp_path, peak=1.0, enable_tensorboard=False),
        clock,
        steps=1,
        tokens=4096,
        step_s=2.0,
        data_s=0.5,
    )
    plain = format_line(10, m, metrics.Colors(False))
    assert "\033[" not in plain
    for piece in (
        "step:    10",
        "loss:   6.0000 (max 7.0000)",
        "grad_norm:  0.5000",
        "tps: 2,048",
        "mfu: ",
        "(data 25.0%)",
        "rss: ",
    ):
        assert piece in plain, (piece, plain)
    colored = format_line(10, m, metrics.Colors(True))
    assert "\033[31m" in colored and colored.endswith("\033[0m")
