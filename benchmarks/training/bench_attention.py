"""block_causal against causal attention: the training step of the debug model, side by side.

    python benchmarks/training/bench_attention.py [--steps 20] [--warmup 3] [--dtype float32] \
        [--ops] [-- --training.seq_len 1024 ...]

One process, one world-size-1 trainer per variant (the real `parallelize`: FSDP2 over a
1-rank gloo mesh, the config's AC and compile; `build_optimizer`; `trainer.train.train_step`),
all with the same weights and the same fixed microbatch: the first of the config's training
data (the stdlib store by default: real documents framed by BOS/EOS). Variants, stepped in
rotating order so a shared machine's drift hits all alike:
- causal: SDPA is_causal (the default);
- block_causal: this device's implementation (`auto`; CPU: one causal SDPA per
  document);
- block_causal, sdpa: SDPA with one additive [batch, 1, seq, seq] mask per microbatch;
- block_causal + document positions (`auto`).
Each figure is the median step time after the warm-up, and the median of the per-round ratios
to causal, on wall time and on this process's CPU time (steadier when other jobs share the
cores); the op table takes the fastest of 7 repetitions. With `--ops`, a second table times the
attention op alone (forward + backward, debug-model heads) for causal SDPA, masked SDPA and
per-document SDPA calls, at a few sequence lengths and document counts: the measurement behind the
CPU path's choice.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result, spread
from benchmarks.training.bench_baseline import _NoMetrics
from trainer.config.job import load_config
from trainer.data import build_dataloader, padded_vocab_size
from trainer.device import resolve_compute_dtype
from trainer.distributed import init_distributed
from trainer.models.build import build_model
from trainer.models.common.attention import attention_args
from trainer.models.common.loss import build_loss
from trainer.models.flavors import model_args
from trainer.optim.optimizer import build_lr_scheduler, build_optimizer
from trainer.parallel.forward_backward import build_forward_backward
from trainer.parallel.parallelize import parallelize
from trainer.step import TrainStep

BLOCK = ["--model.attn_mask_type", "block_causal"]
VARIANTS = {
    "causal": [],
    "block_causal": BLOCK,
    "block_causal, sdpa": [*BLOCK, "--model.attn_implementation", "sdpa"],
    "block_causal+document": [*BLOCK, "--model.positions", "document"],
}


class _Batch:
    """The same microbatch every time, with the real loader's document ids."""

    def __init__(self, loader):
        self.loader, self.batch = loader, loader.next_microbatch()

    def next_microbatch(self):
        return self.batch

    def document_ids(self, inputs):
        return self.loader.document_ids(inputs)


def build_step(cfg, batch, device, pd):
    vocab = cfg.model.vocab_size or padded_vocab_size(
        batch.loader.vocab_size, cfg.model.vocab_size_multiple_of
    )
    args = model_args(
        cfg.model.flavor,
        vocab_size=vocab,
        max_seq_len=cfg.training.seq_len,
        **attention_args(cfg.model, device.type),
    )
    param = resolve_compute_dtype(
        cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce, device
    ).param
    model = parallelize(build_model(args), pd, cfg, device=device, param_dtype=param)
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps)
    loss_fn = build_loss(cfg.training.loss, cfg.training.loss_chunk_size)
    group = pd.dp_mesh.get_group()

    train_step = TrainStep(
        model,
        opt,
        sched,
        batch,
        forward_backward=build_forward_backward(
            model, loss_fn, cfg, parallel_dims=pd, device=device, loader=batch
        ),
        metrics=_NoMetrics(),
        dp_group=group,
        device=device,
        max_norm=cfg.training.max_norm,
    )

    def step() -> float:
        return float(train_step(0, accum=1)[0])

    return step


def step_times(base: list[str], steps: int, warmup: int) -> tuple[dict, dict]:
    cfgs = {name: load_config([*base, *extra]) for name, extra in VARIANTS.items()}
    first = cfgs["causal"]
    device = init_distributed(first)
    pd, _ = first.resolve(1)
    pd.build_mesh(device.type)
    loader = build_dataloader(
        first.data,
        seq_len=first.training.seq_len,
        local_batch_size=first.training.local_batch_size,
        global_batch_size=first.training.local_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=first.job.seed,
    )
    batch = _Batch(loader)
    ids = loader.document_ids(batch.batch[0])
    docs = float((ids.max(dim=1).values + 1).float().mean()) if ids is not None else 1.0
    runs = {name: build_step(cfg, batch, device, pd) for name, cfg in cfgs.items()}
    times = {clock: {name: [] for name in runs} for clock in ("wall", "cpu")}
    names = list(runs)
    for i in range(warmup + steps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            w0, c0 = time.perf_counter(), time.process_time()
            runs[name]()
            if i >= warmup:
                times["wall"][name].append(time.perf_counter() - w0)
                times["cpu"][name].append(time.process_time() - c0)
    info = {
        "docs_per_row": docs,
        "batch": list(batch.batch[0].shape),
        "compute_device": device.type,
    }
    return times, info


def op_times(reps: int = 7) -> list[dict]:
    """Attention alone, forward + backward, debug-model heads (8 x 32), batch 2."""
    from trainer.models.common.attention import build_mask

    rows = []
    for seq in (256, 2048):
        for mean_doc in (4096, seq // 8, 16):
            doc = _doc_ids(2, seq, mean_doc)
            q, k, v = (torch.randn(2, 8, seq, 32, requires_grad=True) for _ in range(3))
            mask = build_mask(doc, "sdpa", torch.float32)
            fns = {
                "causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                "per_document": lambda: _per_document(q, k, v, doc),
            }
            row = {"seq": seq, "docs_per_row": float((doc.max(1).values + 1).float().mean())}
            for name, fn in fns.items():
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn().sum().backward()
                    ts.append(time.perf_counter() - t0)
                row[name] = min(ts)  # the least disturbed repetition (shared cores)
            rows.append(row)
    return rows


def _doc_ids(batch: int, seq: int, mean: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(batch):
        lens = torch.randint(1, 2 * mean, (seq,), generator=gen).cumsum(0)
        starts = torch.zeros(seq, dtype=torch.long)
        starts[lens[lens < seq]] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def _per_document(q, k, v, doc):
    out = []
    for b in range(q.shape[0]):
        counts = torch.unique_consecutive(doc[b], return_counts=True)[1].tolist()
        parts = zip(*(t[b : b + 1].split(counts, dim=2) for t in (q, k, v)), strict=True)
        out.append(
            torch.cat([F.scaled_dot_product_attention(*p, is_causal=True) for p in parts], dim=2)
        )
    return torch.cat(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--config", default=str(REPO / "configs" / "debug_model.toml"))
    ap.add_argument("--steps", type=int, default=20, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--ops", action="store_true", help="also time the attention op alone")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("overrides", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    overrides = [x for x in a.overrides if x != "--"]
    base = [
        "--job.config_file",
        a.config,
        "--training.global_batch_size",
        "-1",
        "--training.mixed_precision_param",
        a.dtype,
        "--checkpoint.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        *overrides,
    ]
    times, info = step_times(base, a.steps, a.warmup)
    print(
        f"{load_config(base).model.flavor}, batch {info['batch'][0]} x {info['batch'][1]} "
        f"({info['docs_per_row']:.1f} documents per row), {a.dtype}, "
        f"{info['compute_device']}, "
        f"{torch.get_num_threads()} threads; {a.steps} rounds after {a.warmup} warm-up"
    )
    result = {}
    for clock, per_variant in times.items():
        ref = per_variant["causal"]
        for name, ts in per_variant.items():
            s, r = spread(ts), spread([t / c for t, c in zip(ts, ref, strict=True)])
            result.setdefault(name, {})[clock] = {"step": s, "ratio_to_causal": r}
            print(
                f"  {clock:<4} {name:<21} median {s['median']:.4f} s/step (p10 "
                f"{s['p10']:.4f}, p90 {s['p90']:.4f}); {r['median']:.3f}x causal (median of "
                f"rounds)"
            )
    ops = op_times() if a.ops else []
    for row in ops:
        print(
            f"  op, seq {row['seq']:>5}, {row['docs_per_row']:5.1f} docs/row: "
            + ", ".join(f"{k} {row[k] * 1e3:7.2f} ms" for k in ("causal", "masked", "per_document"))
        )
    if not a.no_record:
        append_result(
            {
                "bench": "attention",
                "config": a.config,
                "dtype": a.dtype,
                "overrides": overrides,
                "steps": a.steps,
                "warmup": a.warmup,
                "threads": torch.get_num_threads(),
                **info,
                "variants": result,
                "ops": ops,
            }
        )
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    import os

    os._exit(rc)  # skip interpreter teardown: gloo threads can abort it (trainer/train.py)
