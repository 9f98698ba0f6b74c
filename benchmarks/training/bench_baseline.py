"""The trainer at world size 1 against a plain PyTorch loop: same model, batch and optimizer.

    python benchmarks/training/bench_baseline.py [--steps 20] [--warmup 3] [--dtype float32] \
        [-- --training.seq_len 256 ...]

Both run in this one process, step by step in ABBA order (trainer, plain, plain, trainer, ...)
so that drift in a shared machine's speed (other jobs, clocks, thermal) hits both alike; the
figure is the median of the per-pair ratios trainer / plain (goal: <= 1.10), on wall time
and on this process's CPU time (steadier when other jobs share the cores).

- trainer: the real `parallelize` (FSDP2 over a 1-rank gloo mesh, the config's AC and
  compile), `build_optimizer`, `build_lr_scheduler`, and `trainer.train.train_step` (token
  count all-reduce, gradient-sync setting, loss scaling, clip, step, zero_grad).
- plain: `Transformer(args)` on the CPU, `init_weights(seed)` (the same weights), the same
  AdamW and schedule, `cross_entropy(..., reduction="sum") / tokens`, `clip_grad_norm_`.

Both take the same fixed batch, so data loading is excluded from both. In float32 (default)
the two compute the same thing: their losses are printed and must agree to ~1e-6. With
`--dtype bfloat16` the trainer uses FSDP's mixed precision (bf16 compute, fp32 master weights)
and the plain loop `torch.autocast` to bf16, the nearest plain equivalent (losses differ
slightly: autocast keeps some ops in fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, spread
from trainer.config.job import load_config
from trainer.device import resolve_compute_dtype
from trainer.distributed import init_distributed
from trainer.models.build import build_model, new_model
from trainer.models.common.loss import build_loss
from trainer.models.flavors import model_args
from trainer.optim.optimizer import build_lr_scheduler, build_optimizer
from trainer.parallel.forward_backward import build_forward_backward
from trainer.parallel.parallelize import parallelize
from trainer.step import TrainStep


class _NoMetrics:
    """What train_step asks of the metrics processor, doing nothing."""

    def data_timer(self):
        return contextlib.nullcontext()

    def count_tokens(self, n: int) -> None:
        pass


class _FixedBatch:
    """A loader that returns the same microbatch every time."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor):
        self.batch = (inputs, labels)

    def next_microbatch(self):
        return self.batch


def precision(cfg, device):
    """The compute dtype the trainer would use here (training.mixed_precision_param may be auto)."""
    return resolve_compute_dtype(
        cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce, device
    )


def build_trainer_step(cfg, args, batch):
    """The trainer's pieces at world size 1; returns step() -> loss."""
    pd, _ = cfg.resolve(1)
    device = init_distributed(cfg)
    pd.build_mesh(device.type)
    model = parallelize(
        build_model(args), pd, cfg, device=device, param_dtype=precision(cfg, device).param
    )
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps)
    loader, metrics, group = _FixedBatch(*batch), _NoMetrics(), pd.dp_mesh.get_group()
    loss_fn = build_loss(cfg.training.loss, cfg.training.loss_chunk_size)

    train_step = TrainStep(
        model,
        opt,
        sched,
        loader,
        forward_backward=build_forward_backward(
            model, loss_fn, cfg, parallel_dims=pd, device=device
        ),
        metrics=metrics,
        dp_group=group,
        device=device,
        max_norm=cfg.training.max_norm,
    )

    def step() -> float:
        return float(train_step(0, accum=1)[0])

    return step


def build_plain_step(cfg, args, batch):
    """A single-process loop on the same model, weights, batch and optimizer."""
    with torch.device("cpu"):
        model = new_model(args)
    model.init_weights(cfg.job.seed)
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps)
    inputs, labels = batch
    bf16 = precision(cfg, torch.device("cpu")).param == "bfloat16"

    def step() -> float:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            logits = model(inputs)
        loss = (
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            / labels.numel()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def timed(step) -> tuple[float, float, float]:
    """(wall s, CPU s of this process, loss). CPU time counts every thread of ours (gloo's
    included) and none of the other jobs on a shared machine: the steadier of the two there."""
    w0, c0 = time.perf_counter(), time.process_time()
    loss = step()
    return time.perf_counter() - w0, time.process_time() - c0, loss


def run_pairs(steps: dict, n: int, warmup: int) -> dict[str, dict[str, list]]:
    """ABBA-ordered timings; the first `warmup` pairs are dropped."""
    out = {k: {"wall": [], "cpu": [], "loss": []} for k in steps}
    for i in range(warmup + n):
        order = ["trainer", "plain"] if i % 2 == 0 else ["plain", "trainer"]
        for name in order:
            wall, cpu, loss = timed(steps[name])
            out[name]["loss"].append(loss)
            if i >= warmup:
                out[name]["wall"].append(wall)
                out[name]["cpu"].append(cpu)
    return out


def compare(r: dict, clock: str) -> dict:
    """Spreads of both sides' step times and of the per-pair ratio, on one clock."""
    t, p = r["trainer"][clock], r["plain"][clock]
    return {
        "trainer": spread(t),
        "plain": spread(p),
        "ratio": spread([x / y for x, y in zip(t, p, strict=True)]),
    }


def print_comparison(name: str, c: dict) -> None:
    t, p, q = c["trainer"], c["plain"], c["ratio"]
    print(
        f"{name}: trainer (FSDP, world 1) median {t['median']:.4f} s/step "
        f"(p10 {t['p10']:.4f}, p90 {t['p90']:.4f}); plain loop median {p['median']:.4f} s/step "
        f"(p10 {p['p10']:.4f}, p90 {p['p90']:.4f})"
    )
    print(
        f"    ratio trainer/plain: {q['median']:.3f}x median of pairs (p10 {q['p10']:.3f}, "
        f"p90 {q['p90']:.3f}); {t['median'] / p['median']:.3f}x ratio of medians; "
        f"goal <= 1.10x"
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--config", default=str(REPO / "configs" / "debug_model.toml"))
    ap.add_argument("--steps", type=int, default=20, help="timed pairs")
    ap.add_argument("--warmup", type=int, default=3, help="untimed pairs first")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads for both (default: torch's, i.e. the cores)",
    )
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("overrides", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    overrides = [x for x in a.overrides if x != "--"]
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = load_config(
        [
            "--job.config_file",
            a.config,
            "--data.dataset",
            "synthetic",
            "--training.global_batch_size",
            "-1",
            "--training.mixed_precision_param",
            a.dtype,
            *overrides,
        ]
    )
    args = model_args(
        cfg.model.flavor,
        vocab_size=cfg.model.vocab_size or cfg.data.vocab_size,
        max_seq_len=cfg.training.seq_len,
        n_layers=cfg.model.n_layers,
    )
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    batch = tuple(torch.randint(0, args.vocab_size, shape, generator=gen) for _ in range(2))
    steps = {
        "trainer": build_trainer_step(cfg, args, batch),
        "plain": build_plain_step(cfg, args, batch),
    }
    r = run_pairs(steps, a.steps, a.warmup)
    loss_diff = max(
        abs(x - y) for x, y in zip(r["trainer"]["loss"], r["plain"]["loss"], strict=True)
    )
    wall, cpu = compare(r, "wall"), compare(r, "cpu")
    print(
        f"model: {cfg.model.flavor}, batch {shape[0]} x {shape[1]}, {a.dtype}, "
        f"{torch.get_num_threads()} threads; {a.steps} pairs after {a.warmup} warm-up (ABBA)"
    )
    print_comparison("wall time", wall)
    print_comparison("CPU time ", cpu)
    print(f"max |loss difference| over {len(r['plain']['loss'])} steps: {loss_diff:.2e}")
    if not a.no_record:
        append_result(
            {
                "bench": "baseline",
                "config": cfg.job.config_file,
                "dtype": a.dtype,
                "overrides": overrides,
                "steps": a.steps,
                "warmup": a.warmup,
                "threads": torch.get_num_threads(),
                "wall": wall,
                "cpu": cpu,
                "max_loss_diff": loss_diff,
            }
        )
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    import os

    os._exit(rc)  # skip interpreter teardown: gloo threads can abort it (trainer/train.py)
