"""The printed memory plan: the breakdown table, the verdict, the communication per step and
mesh dimension (trainer/plan/comm.py), the throughput at an assumed MFU, and the command line
of `python -m trainer.plan` (trainer/plan/memory.py computes the plan)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

from trainer.config.job import JobConfig, load_config
from trainer.errors import ConfigError, UserError
from trainer.models.flops import table_peak_tflops
from trainer.optim.optimizer import implementation
from trainer.plan.comm import comm_volume
from trainer.plan.host import HOST_ROWS, host_ram_gib, host_report
from trainer.plan.memory import (
    CONTEXT_GIB,
    FRAGMENTATION,
    GIB,
    GPUS,
    Gpu,
    accumulation_sync_note,
    device_need,
    largest_local_batch,
    memory_plan,
    plan_args,
    resolve_vocab,
    throughput,
)
from trainer.plan.pipeline import summary as pipeline_summary

# --------------------------------------------------------------------------- report

ROWS = [  # (key, label) in print order; None = a heading
    (None, "resident (sharded; in host memory with offload: see below)"),
    ("parameters", "parameters (fp32)"),
    ("gradients", "gradients (fp32)"),
    ("optimizer_state", "optimizer state (fp32: AdamW 2 + step, Muon 1)"),
    ("buffers_and_inputs", "RoPE buffers + input/label tokens"),
    (None, "per microbatch"),
    ("activations_no_ac", "activations, no AC"),
    ("activations_full_ac", "activations, full AC"),
    ("activations", "activations, as configured ({ac})"),
    ("attention_inputs", "  of which mask + RoPE tables ({attn})"),
    ("cp_kv", "  of which CP: all-gathered K/V saved per layer"),
    ("ac_recompute", "one block recomputed in backward"),
    ("logits_loss", "logits + loss at its widest ({loss})"),
    (None, "FSDP buffers ({mp}; reshard {reshard})"),
    ("fsdp_loss", "kept unsharded at the loss"),
    ("fsdp_head", "head backward (+ prefetched block)"),
    ("fsdp_block", "block backward (+ prefetch, rs in flight)"),
    ("fsdp_embedding", "embedding backward"),
    ("tp_buffers", "TP: whole-sequence grads around collectives"),
    ("grad_accumulation", "unsharded grads kept for accumulation"),
    ("optimizer_step_temp", "optimizer step temporaries ({impl})"),
    ("offload_staging", "offload: host-to-device shard copies, one grad shard"),
    (None, "device total at each moment"),
    ("peak_loss", "loss backward"),
    ("peak_head_backward", "output head backward"),
    ("peak_block_backward", "top block backward"),
    ("peak_end_of_backward", "end of backward (embedding)"),
    ("peak_optimizer_step", "optimizer step"),
]


def describe(cfg: JobConfig, world_size: int, ngpu: int, nnodes: int) -> list[str]:
    """The header: model, vocab source, mesh, microbatch and dtypes."""
    pd, accum = cfg.resolve(world_size)
    vocab, source = resolve_vocab(cfg)
    a = plan_args(cfg, vocab)
    t = cfg.training
    return [
        f"model: {cfg.model.flavor}, {a.num_params() / 1e9:.3f}B params, vocab {vocab} "
        f"(from {source})",
        f"mesh: {pd.describe()} = {ngpu} GPU(s) x {nnodes} node(s); parameters sharded over "
        + (
            f"{pd.dp_shard * pd.cp} rank(s)"
            if pd.tp == 1
            else f"tp {pd.tp} x dp_shard {pd.dp_shard * pd.cp} = "
            f"{pd.tp * pd.dp_shard * pd.cp} ranks "
            f"(norms over {pd.dp_shard * pd.cp})"
        ),
        f"microbatch: {t.local_batch_size} x {t.seq_len} tokens, {accum} microbatch(es) per step "
        f"(sync '{t.gradient_accumulation_sync}')",
    ]


def report(
    cfg: JobConfig,
    b: dict[str, int],
    accum: int,
    gpu: Gpu,
    mem_gib: float,
    mfu: float,
    host: tuple[int, float, str] = (1, math.inf, "unlimited"),
) -> list[str]:
    """The breakdown table, the verdict and the throughput at the assumed MFU. `host`:
    (ranks per node, GiB of host RAM per node, where that figure comes from)."""
    t, ac = cfg.training, cfg.activation_checkpoint
    unit, scale = ("GiB", GIB) if b["total"] >= GIB else ("MiB", 2**20)
    fill = {
        "ac": ac.mode + (f" {ac.selective_ac_option}" if ac.mode == "selective" else ""),
        "loss": (
            f"eager, fp32 [{t.local_batch_size}, {t.seq_len}, vocab]"
            if t.loss == "eager"
            else f"chunked, {t.loss_chunk_size} tokens at a time"
        ),
        "mp": f"{t.mixed_precision_param.replace('auto', 'bfloat16 (auto)')} params, "
        f"{t.mixed_precision_reduce} reduce",
        "reshard": cfg.parallelism.fsdp_reshard_after_forward,
        "impl": implementation(cfg.optimizer.implementation),
        "offload": f"fsdp_offload {cfg.parallelism.fsdp_offload}",
        "attn": f"{cfg.model.attn_mask_type}, {cfg.model.positions}",
    }
    lines = []
    for key, label in ROWS + HOST_ROWS:
        label = label.format(**fill)
        value = "" if key is None else f" {b[key] / scale:10.3f} {unit}"
        lines.append(f"  {label}" if key is None else f"    {label:<50}{value}")
    phase = max((k for k in b if k.startswith("peak_")), key=b.get)
    need, have = device_need(b["total"]), mem_gib * GIB
    reserve = need - b["total"]
    host_lines, host_fits = host_report(b, *host)
    verdict = "FITS" if need <= have and host_fits else "DOES NOT FIT"
    lines += [
        f"  peak: {b['total'] / GIB:.3f} GiB (at the {dict(ROWS)[phase]}) + reserve "
        f"{reserve / GIB:.2f} GiB (CUDA context {CONTEXT_GIB} GiB + {FRAGMENTATION:.0%} "
        f"fragmentation) = {need / GIB:.2f} GiB of {have / GIB:.1f} GiB",
        *host_lines,
        f"verdict: {verdict} on {gpu.name} ({(have - need) / GIB:+.2f} GiB device headroom"
        f"{'' if host_fits else '; not enough host memory'})",
    ]
    if "pp_rank_totals" in b:
        lines += pipeline_summary(cfg, b["pp_rank_totals"], GIB)
    return lines + comm_report(b) + throughput_report(cfg, gpu, mfu, accum)


def comm_report(b: dict) -> list[str]:
    """Bytes each rank sends per optimizer step over each mesh dimension (trainer/plan/comm.py)."""
    if "comm_tp" not in b:
        return []
    m = b["comm_microbatches"]
    return [
        f"communication per optimizer step, bytes each rank sends ({m} microbatch(es); "
        "formulas: trainer/plan/comm.py)",
        f"    {'tp (sequence-parallel activations, loss, norms)':<50} "
        f"{b['comm_tp'] / GIB:10.3f} GiB",
        f"    {'cp (K/V all-gathers + gradient reduce-scatters)':<50} "
        f"{b.get('comm_cp', 0.0) / GIB:10.3f} GiB",
        f"    {'dp_shard (x cp: FSDP all-gathers + reduce-scatters)':<50} "
        f"{b['comm_dp_shard'] / GIB:10.3f} GiB",
        f"    {'dp_replicate (HSDP all-reduce)':<50} {b['comm_dp_replicate'] / GIB:10.3f} GiB",
        f"    {'pp (stage activations and their gradients, p2p)':<50} "
        f"{b.get('comm_pp', 0.0) / GIB:10.3f} GiB",
        f"    {'ep (routed tokens, all-to-all)':<50} {b.get('comm_ep', 0.0) / GIB:10.3f} GiB",
    ] + (
        [
            f"    {'optimizer (Muon: updates to owners, results back)':<50} "
            f"{b['comm_optimizer'] / GIB:10.3f} GiB; Newton-Schulz "
            f"{b['muon_ns_flops'] / 1e12:.2f} TFLOPs on the busiest rank (mean "
            f"{b['muon_ns_flops_mean'] / 1e12:.2f})"
        ]
        if "muon_ns_flops" in b
        else []
    )


def throughput_report(cfg: JobConfig, gpu: Gpu, mfu: float, accum: int) -> list[str]:
    """Tokens/s per device at the assumed MFU and the step time. MFU is per device: a dp
    rank's tokens are computed by its tp devices, so a dp rank runs tp x the per-device rate."""
    peak = table_peak_tflops(gpu.name)
    if not peak:
        return []
    t, tp = cfg.training, cfg.parallelism.tensor_parallel_degree
    fpt, tps = throughput(cfg, peak[0], mfu)
    # a dp rank's tokens go through its tp x pp devices (the pipeline's bubble is idle time
    # inside the assumed MFU)
    step_s = (
        t.local_batch_size
        * t.seq_len
        * accum
        / (tps * tp * cfg.parallelism.pipeline_parallel_degree)
    )
    per_dp = f", {tps * tp:,.0f} per dp rank of {tp} devices" if tp > 1 else ""
    return [
        f"throughput at {mfu:.0%} MFU of {peak[0]:g} TFLOPS bf16 ({peak[1]}): "
        f"{tps:,.0f} tokens/s per device{per_dp} ({fpt:.4g} FLOPs/token; "
        f"{step_s:.3g} s per optimizer step)"
    ]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every other user error (not the usage)
        print(
            f"config error: python -m trainer.plan: {message} (--help lists the flags)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)


def parse_args(argv: list[str]):
    """Our flags; every other argument is a config override (`--section.key value`)."""
    ap = _Parser(
        prog="python -m trainer.plan",
        allow_abbrev=False,
        description="Per-device memory plan and a fits/does-not-fit verdict; other "
        "arguments are config overrides.",
    )
    ap.add_argument("--config", required=True, help="TOML config file")
    ap.add_argument("--ngpu", type=int, required=True, help="GPUs per node")
    ap.add_argument("--nnodes", type=int, default=1, help="nodes (world = ngpu * nnodes)")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU model")
    ap.add_argument("--gpu-mem-gib", type=float, help="override the GPU's memory (GiB)")
    ap.add_argument("--mfu", type=float, default=0.40, help="assumed MFU for tokens/s")
    ap.add_argument(
        "--host-gib", type=float, help="host RAM per node (default: this machine's MemTotal)"
    )
    ap.add_argument(
        "--json",
        action="store_true",
        help="print the whole report (the plan, and the trace with --trace) as one "
        "JSON object on stdout instead of the text, for scripts and sweeps",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="also run one real training step at these shapes on fake tensors "
        "(trainer/plan/trace.py) and print its peak beside the plan's",
    )
    return ap.parse_known_args(argv)


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    if args.json:  # stdout is the JSON object alone: whatever else is written goes to stderr
        with stdout_to_stderr():
            code, out = run(args, overrides)
        if out is not None:
            print(out, flush=True)
        return code
    return run(args, overrides)[0]


@contextlib.contextmanager
def stdout_to_stderr():
    """stdout, Python's and its file descriptor's, sent to stderr for the block: the log lines
    of the traced ranks' forked processes and any library's C-level prints."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args, overrides: list[str]) -> tuple[int, str | None]:
    """The report of `python -m trainer.plan` as text on stdout (None), or with `--json` the
    JSON object to print; and the exit code. LOCAL_WORLD_SIZE (a node's ranks, as torchrun
    says: the dispatch and the traffic's nodes) is --ngpu while it runs, then restored: a
    caller's later plans and traces in the same process see their own."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        return _run(args, overrides)
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def _run(args, overrides: list[str]) -> tuple[int, str | None]:
    try:
        if args.ngpu < 1 or args.nnodes < 1:
            raise ConfigError(f"--ngpu ({args.ngpu}) and --nnodes ({args.nnodes}) must be >= 1")
        for flag, value in (
            ("--gpu-mem-gib", args.gpu_mem_gib),
            ("--host-gib", args.host_gib),
            ("--mfu", args.mfu),
        ):
            if value is not None and not (0 < value and (flag != "--mfu" or value <= 1)):
                raise ConfigError(
                    f"{flag} = {value:g} is out of range: it must be > 0"
                    + (" and <= 1 (a fraction of the peak)" if flag == "--mfu" else " (GiB)")
                )
        cfg = load_config(["--job.config_file", args.config, *overrides])
        world = args.ngpu * args.nnodes
        os.environ["LOCAL_WORLD_SIZE"] = str(args.ngpu)  # a node's ranks, as torchrun says
        header = describe(cfg, world, args.ngpu, args.nnodes)
        b = {**memory_plan(cfg, world), **comm_volume(cfg, world)}
        accum = cfg.resolve(world)[1]
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return e.exit_code, None
    gpu = GPUS[args.gpu]
    mem_gib = args.gpu_mem_gib or gpu.memory_gib
    host = (args.ngpu, *host_ram_gib(args.host_gib or 0.0))
    best = largest_local_batch(cfg, world, mem_gib)
    fixed = cfg.training.global_batch_size != -1
    if args.json:
        return 0, report_json(cfg, world, b, accum, gpu, mem_gib, best, args.trace)
    print(
        "\n".join(
            header
            + report(cfg, b, accum, gpu, mem_gib, args.mfu, host)
            + [
                f"largest local_batch_size that fits: {best}"
                + (
                    f" (of those dividing global_batch_size {cfg.training.global_batch_size})"
                    if fixed
                    else ""
                )
            ]
        ),
        flush=True,
    )
    note = accumulation_sync_note(cfg, world, mem_gib)
    if note:
        print(note)
    if args.trace:
        from trainer.plan.trace import trace_lines

        print("\n".join(trace_lines(cfg, world, b, mem_gib, device_need)))
    return 0, None


def report_json(
    cfg, world: int, b: dict, accum: int, gpu, mem_gib: float, best: int, trace: bool
) -> str:
    """`--json`: the plan (and trace) as one JSON object (`trace.work`: the busiest traced
    rank's work against its share and the measured factors, trainer/plan/work.py)."""
    import json

    dims = ("tp", "cp", "dp_shard", "dp_replicate", "ep", "pp", "optimizer")
    out = {
        "world_size": world,
        "accumulation": accum,
        "gpu": gpu.name,
        "memory_gib": mem_gib,
        "largest_local_batch": best,
        "plan": {
            "peak_gib": b["total"] / GIB,
            "fits": device_need(b["total"]) <= mem_gib * GIB,
            "comm_bytes": {d: b.get(f"comm_{d}", 0.0) for d in dims},
            "bytes": b,
            # Muon: Newton-Schulz FLOPs per step from the optimizer's owners
            "muon_ns_flops": {"busiest_rank": b["muon_ns_flops"], "mean": b["muon_ns_flops_mean"]}
            if "muon_ns_flops" in b
            else None,
        },
        "trace": None,
        "ideal_flops_per_rank": None,
    }
    if trace:
        from trainer.plan.trace import trace_lines

        traced: dict = {}
        lines = trace_lines(cfg, world, b, mem_gib, device_need, traced)
        if traced:
            out["trace"] = {
                "peak_gib": traced["peak_bytes"] / GIB,
                "pp_ranks": traced["pp_ranks"],
                "flops_per_rank": traced["flops"],
                "largest": traced["largest"],
                "categories": traced["categories"],
                "seconds": traced["seconds"],
                "comm_bytes": traced["comm_bytes"],
                # GiB per rank per step to other nodes, by dimension (traffic.py)
                "internode_bytes": {
                    k.removesuffix("@internode"): v / GIB
                    for k, v in traced["comm_bytes"].items()
                    if k.endswith("@internode")
                },
                "muon_ns_flops": traced["muon_ns_flops"],  # this rank's, traced
                "work": traced["work"],
                "lines": lines,
            }
            out["ideal_flops_per_rank"] = traced["ideal_flops"]
        else:
            out["trace"] = {"lines": lines}
    return json.dumps(out, indent=1, default=float)
