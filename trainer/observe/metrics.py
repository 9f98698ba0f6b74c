"""What a run reports: throughput, MFU, memory and losses, to TensorBoard, W&B and the console.

The loop drives one `MetricsProcessor` per rank:

    mp = MetricsProcessor(cfg, model_args=..., seq_len=..., device=..., rank=..., ...)
    mp.log_startup()
    mp.open()                       # rank 0: TensorBoard and W&B, once the run goes on
    try:
        for step in ...:
            mp.step_timer()
            with mp.data_timer():
                batch = next(loader)
            mp.count_tokens(batch.numel())
            ...
            if step % log_freq == 0:
                mp.log(step, global_avg_loss=..., global_max_loss=..., grad_norm=..., lr=...,
                       tokens_seen=...)
    finally:
        mp.close()      # or `with mp:`, which gives W&B the exit code of an exception

Figures are averages over the steps since the previous `log` (so a checkpoint save between
two logs shows up in end-to-end time, as it does for the user). Throughput is per device.
Memory is this rank's own: peaks since the previous log on CUDA; on CPU the process's peak RSS
since it started (Linux cannot reset it).

TensorBoard (rank 0) writes to `{dump_folder}/{save_tb_folder}/<YYYYmmdd-HHMMSS>`, one folder per
launch (a resumed run gets a new one; TensorBoard overlays them by step), with torchtitan's tag
names so existing dashboards work. `mfu(%)` is written only when a peak is known (see
`trainer.models.flops.resolve_peak`); the config is recorded as text and as hparams.

Weights & Biases (`[metrics] enable_wandb`, rank 0, trainer/observe/wandb_logger.py) gets the same
scalars at the same steps, and the config as the run config. Each of the two is a "sink" with
`write(step, scalars)` and `close(exit_code)`; either, both or neither can be on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import sys
import time

import torch

from trainer.device import Precision, resolve_compute_dtype
from trainer.models import registry
from trainer.models.args import ModelArgs
from trainer.models.flops import attention_flops_per_token, flops_per_token, resolve_peak

__all__ = ["MetricsProcessor", "flops_per_token"]

GIB = 2**30
DEBUG_RANK_LOSS_ENV = "TRAINER_DEBUG_RANK_LOSS"
_clock = time.perf_counter  # module-level so tests can drive time deterministically


# --------------------------------------------------------------------------- memory


def memory_metrics(device: torch.device) -> dict[str, float]:
    """This rank's memory tags: allocator peaks on CUDA, and the host's peak RSS everywhere
    (with fsdp_offload the sharded state lives there)."""
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    rss_units = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = {"memory/max_rss(GiB)": rss_units * (1 if sys.platform == "darwin" else 1024) / GIB}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        active = stats.get("active_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        return {
            "memory/max_active(GiB)": active / GIB,
            "memory/max_active(%)": 100 * active / total,
            "memory/max_reserved(GiB)": reserved / GIB,
            "memory/max_reserved(%)": 100 * reserved / total,
            "memory/num_alloc_retries": stats.get("num_alloc_retries", 0),
            "memory/num_ooms": stats.get("num_ooms", 0),
            **rss,
        }
    return rss


def reset_memory_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# --------------------------------------------------------------------------- console


def use_color(disable_color: bool, stream=None) -> bool:
    """Colors unless `[metrics] disable_color`, NO_COLOR is set, or the output is not a terminal.

    The terminal check keeps escape codes out of log files (`| tee`, SLURM's .out files);
    FORCE_COLOR=1 brings them back there. See https://no-color.org.
    """
    stream = stream or sys.stdout
    if disable_color or os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return hasattr(stream, "isatty") and stream.isatty()


class Colors:
    """ANSI codes, all empty strings when color is off."""

    _CODES = dict(red="31", green="32", yellow="33", blue="34", magenta="35", cyan="36", reset="0")

    def __init__(self, enabled: bool):
        for name, code in self._CODES.items():
            setattr(self, name, f"\033[{code}m" if enabled else "")


def format_line(step: int, m: dict[str, float], c: Colors) -> str:
    """One console line with the figures of the TensorBoard tags (`m`, keyed by tag)."""
    if "memory/max_reserved(GiB)" in m:
        memory = (
            f"memory: {m['memory/max_reserved(GiB)']:5.2f}GiB({m['memory/max_reserved(%)']:.1f}%)"
        )
    else:
        memory = f"rss: {m['memory/max_rss(GiB)']:5.2f}GiB"
    parts = [
        f"{c.red}step: {step:>5}",
        f"{c.green}loss: {m['loss_metrics/global_avg_loss']:8.4f} "
        f"(max {m['loss_metrics/global_max_loss']:.4f}"
        + (f", z {m['loss_metrics/z_loss']:.2e}" if "loss_metrics/z_loss" in m else "")
        + (f", mtp {m['loss_metrics/mtp_loss']:.4f}" if "loss_metrics/mtp_loss" in m else "")
        + ")",
        f"{c.reset}grad_norm: {m['grad_norm']:7.4f}",
        f"lr: {m['lr']:.2e}",
        f"{c.yellow}{memory}",
        f"{c.blue}tps: {m['throughput(tps)']:,.0f}",
        f"{c.cyan}tflops: {_num(m['tflops'])}",
    ]
    if "mfu(%)" in m:
        parts.append(f"{c.magenta}mfu: {_num(m['mfu(%)'])}%")
    parts.append(
        f"{c.reset}time: {m['time_metrics/end_to_end(s)']:.3f}s/step "
        f"(data {m['time_metrics/data_loading(%)']:.1f}%){c.reset}"
    )
    return "  ".join(parts)


def _num(x: float) -> str:
    """Two decimals as on a GPU (412.35), but significant digits for CPU-sized values."""
    return f"{x:,.2f}" if abs(x) >= 1 else f"{x:.3g}"


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


# --------------------------------------------------------------------------- TensorBoard


def _run_folder(root: str) -> str:
    """A new `<root>/<timestamp>` folder (suffixed -1, -2... if two launches share a second)."""
    base = os.path.join(root, time.strftime("%Y%m%d-%H%M%S"))
    path, i = base, 0
    while os.path.exists(path):
        i += 1
        path = f"{base}-{i}"
    os.makedirs(path)
    return path


def _flat_config(cfg) -> dict:
    """The config flattened to `section.key` scalars, the form the hparams plugin accepts."""
    out = {}
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            scalar = isinstance(v, (bool, int, float, str))
            out[f"{section.name}.{f.name}"] = v if scalar else str(v)
    return out


def _open_writer(cfg, extra_hparams: dict):
    """SummaryWriter with the effective config as text and as hparams (for run comparison);
    `extra_hparams` as `derived.<name>`."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    root = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
    writer = SummaryWriter(_run_folder(root))
    writer.add_text("config", "```toml\n" + cfg.to_toml() + "\n```", global_step=0)
    # add_hparams would create a sub-run; writing the summaries directly keeps one run folder,
    # and the plugin reads the metric from the run's own loss scalars.
    derived = {f"derived.{name}": value for name, value in extra_hparams.items()}
    summaries = hparams({**_flat_config(cfg), **derived}, {"loss_metrics/global_avg_loss": 0.0})
    for summary in summaries:
        writer.file_writer.add_summary(summary)
    return writer


class TensorBoardSink:
    """Rank 0's SummaryWriter, flushed at every write (cheap at log_freq; a killed job keeps
    its tail)."""

    def __init__(self, cfg, derived: dict):
        self.writer = _open_writer(cfg, derived)

    def describe(self) -> str:
        return f"tensorboard: {self.writer.log_dir}"

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self, exit_code: int = 0) -> None:
        self.writer.flush()
        self.writer.close()


def open_sinks(cfg, derived: dict) -> list:
    """Rank 0's enabled sinks. W&B opens first: its init is the one that may fail (a user
    error then, which train.py makes every rank raise), and it would leave no TensorBoard
    folder behind."""
    wandb = []
    if cfg.metrics.enable_wandb:
        from trainer.observe.wandb_logger import (
            WandbLogger,
        )  # rank 0 only: other ranks never import it

        wandb.append(WandbLogger(cfg, derived))
    tensorboard = [TensorBoardSink(cfg, derived)] if cfg.metrics.enable_tensorboard else []
    return tensorboard + wandb


def exit_code_of(exc: BaseException | None) -> int:
    """The code the process will exit with for `exc` (train.main's mapping): 0 without one,
    the user error's or Preempted's own code, else 1."""
    return 0 if exc is None else getattr(exc, "exit_code", 1)


# --------------------------------------------------------------------------- processor


class MetricsProcessor:
    """Times steps, counts tokens, and on log steps writes TensorBoard and W&B and prints
    (rank 0). A context manager: leaving it closes the sinks with the exception's exit code."""

    def __init__(
        self,
        cfg,
        *,
        model_args: ModelArgs,
        seq_len: int,
        device: torch.device,
        rank: int,
        parallel_desc: str,
        accumulation_steps: int,
        num_params: int,
        precision: Precision | None = None,
        model_parallel: int = 1,
    ):
        """`model_parallel`: devices that compute one dp rank's tokens together (the tp
        degree): throughput, TFLOPS and MFU are per device, so a rank counts 1/tp of them."""
        self.cfg, self.model_args, self.seq_len = cfg, model_args, seq_len
        self.model_parallel = model_parallel
        self.device, self.rank = device, rank
        self.precision = precision or resolve_compute_dtype(
            cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce, device
        )
        self.parallel_desc, self.accumulation_steps, self.num_params = (
            parallel_desc,
            accumulation_steps,
            num_params,
        )
        self.flops_per_token = flops_per_token(model_args, seq_len)
        self.peak = resolve_peak(cfg.metrics.peak_tflops, device)
        self.colors = Colors(use_color(cfg.metrics.disable_color))
        self.sinks: list = []  # opened by open() once the run may write (after the resume)
        self._derived = {
            "flops_per_token": self.flops_per_token,
            "peak_tflops": self.peak.tflops or 0.0,
            "num_params": num_params,
            "accumulation_steps": accumulation_steps,
            "parallel": parallel_desc,
            "device": str(device),
            "compute_dtype": self.precision.param,
        }
        self._interval_start: float | None = None
        self._steps = self._tokens = 0
        self._data_s = 0.0

    def log_startup(self) -> None:
        """Rank 0: what is trained, how it is split, and what MFU will be measured against."""
        if self.rank != 0:
            return
        a, c = self.model_args, self.colors
        attn_half = attention_flops_per_token(a, self.seq_len, causal_half=True)
        peak = (
            f"MFU peak: {self.peak.tflops:g} TFLOPS bf16 per device, from {self.peak.source}"
            if self.peak.tflops
            else f"MFU peak: {self.peak.source}"
        )
        lines = [
            f"model: {_human(self.num_params)} params ({_human(a.num_params(embeddings=False))} "
            f"non-embedding), {a.n_layers} layers, dim {a.dim}, {a.n_heads} heads "
            f"({a.n_kv_heads} kv), vocab {a.vocab_size}",
            f"FLOPs/token: {self.flops_per_token:.4g} fwd+bwd at seq_len {self.seq_len} "
            f"(6*N_matmul + 12*L*H*hd*S; causal attention counted in full, "
            f"{self.flops_per_token - attn_half:.4g} if halved"
            + (
                "; block_causal counted as causal over the whole window, though its kernels "
                "skip other documents"
                if a.attn_mask_type == "block_causal"
                else ""
            )
            + ")",
            registry.hooks(a).attention_summary(a, self.device.type),
            f"mesh: {self.parallel_desc}; gradient accumulation steps: {self.accumulation_steps}",
            f"device: {self.device.type} ({'nccl' if self.device.type == 'cuda' else 'gloo'}"
            f"{', ' if self.device.type == 'cuda' else ''}"
            f"{torch.cuda.get_device_name(self.device) if self.device.type == 'cuda' else ''}"
            f"); {self.precision.describe()}",
            peak,
        ]
        if self.peak.tflops and self.precision.param != "bfloat16":
            lines.append(
                f"note: MFU is against the bf16 peak; this run computes in {self.precision.param}"
            )
        for line in lines:
            _write_line(f"{c.cyan}{line}{c.reset}")

    def open(self) -> None:
        """Rank 0 opens TensorBoard and W&B, and says where they write. Called once the run
        is known to go on: a refused resume leaves the dump folder as it was."""
        if self.rank != 0:
            return
        self.sinks = open_sinks(self.cfg, self._derived)
        for sink in self.sinks:
            _write_line(f"{self.colors.cyan}{sink.describe()}{self.colors.reset}")

    def step_timer(self) -> None:
        """Call at the start of each step; the first call starts the first interval."""
        if self._interval_start is None:
            self._interval_start = _clock()
        self._steps += 1

    def restart_interval(self) -> None:
        """Drop the interval in progress (after a rollback: its steps are trained again)."""
        self._interval_start, self._steps, self._tokens, self._data_s = None, 0, 0, 0.0

    @contextlib.contextmanager
    def data_timer(self):
        """Wraps the data loading inside a step; its time is reported as data_loading."""
        t0 = _clock()
        try:
            yield
        finally:
            self._data_s += _clock() - t0

    def count_tokens(self, n: int) -> None:
        """Tokens of this dp rank in this step (all microbatches); under tensor parallelism
        each of its `model_parallel` devices does 1/model_parallel of their work."""
        self._tokens += int(n) / self.model_parallel

    def log(
        self,
        step: int,
        *,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        lr: float,
        tokens_seen: int,
        local_loss: float | None = None,
        z_loss: float | None = None,
        mtp_loss: float | None = None,
    ) -> dict[str, float]:
        """Close the interval; rank 0 writes its sinks (TensorBoard flushed, W&B) and prints
        one line.

        Every rank calls this (it resets its counters); it does no collective. Returns the
        figures by tag, which tests and callers can use. With TRAINER_DEBUG_RANK_LOSS=1, every
        rank also prints its own `local_loss` (to check the dp reduction, or find a rank whose
        data or weights diverge; show the ranks with LOG_RANK=0,1,...). `z_loss` (the global
        mean z-loss term per token, with `training.z_loss_weight`) is logged as
        `loss_metrics/z_loss`; `global_avg_loss` is the cross-entropy alone. `mtp_loss` (the
        multi-token prediction modules' mean loss per token) is `loss_metrics/mtp_loss`.
        """
        if local_loss is not None and os.environ.get(DEBUG_RANK_LOSS_ENV):
            _write_line(f"rank {self.rank} step {step} local_loss {float(local_loss)!r}")
        m = {
            "loss_metrics/global_avg_loss": float(global_avg_loss),
            "loss_metrics/global_max_loss": float(global_max_loss),
            **({} if z_loss is None else {"loss_metrics/z_loss": float(z_loss)}),
            **({} if mtp_loss is None else {"loss_metrics/mtp_loss": float(mtp_loss)}),
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "n_tokens_seen": float(tokens_seen),
            **self._interval_metrics(),
            **memory_metrics(self.device),
        }
        reset_memory_peaks(self.device)
        if self.rank == 0:
            self._write(step, m)
            _write_line(format_line(step, m, self.colors))
        return m

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        """Rank 0: write extra scalars (validation, skipped steps, spikes, data) now."""
        self._write(step, {tag: float(value) for tag, value in values.items()})

    def _write(self, step: int, values: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, values)

    def _interval_metrics(self) -> dict[str, float]:
        """Throughput, FLOPS, MFU and timings over the steps since the last log; then reset."""
        now = _clock()
        start = self._interval_start if self._interval_start is not None else now
        elapsed, steps = max(now - start, 1e-9), max(self._steps, 1)
        tps = self._tokens / elapsed
        m = {
            "throughput(tps)": tps,
            "tflops": self.flops_per_token * tps / 1e12,
            "time_metrics/end_to_end(s)": elapsed / steps,
            "time_metrics/data_loading(s)": self._data_s / steps,
            "time_metrics/data_loading(%)": 100 * self._data_s / elapsed,
        }
        if self.peak.tflops:
            m["mfu(%)"] = 100 * self.flops_per_token * tps / (self.peak.tflops * 1e12)
        self._interval_start, self._steps, self._tokens, self._data_s = now, 0, 0, 0.0
        return m

    def close(self, exit_code: int = 0) -> None:
        """Flush and close the sinks (W&B records `exit_code`); idempotent, so it can sit in a
        `finally`."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(exit_code)

    def __enter__(self) -> "MetricsProcessor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code_of(exc))


def _write_line(line: str) -> None:
    """One write per line (print writes the newline apart): ranks share the pipe."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()
