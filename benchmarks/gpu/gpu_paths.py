"""Every CUDA-only path of the trainer, run once through run_train.sh on this machine's GPU.

    python benchmarks/gpu/gpu_paths.py [NAME ...]        # all paths, or the ones named
    python benchmarks/gpu/gpu_paths.py --list

Each path trains the debug model (or the shape it names) for STEPS steps on one GPU and is
judged by what a user would look at: the exit code, the logged loss falling (the mean of the
last five logged losses below the mean of the first five), and the line or file the path must
produce. A table at the end; exit 1 if any path failed. Functional, not a benchmark: the
figures of speed are benchmarks/gpu/gpu_suite.sh's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, env, tb_scalars

DEBUG = str(REPO / "configs" / "debug_model.toml")
DSV3 = str(REPO / "configs" / "debug_dsv3.toml")
ONE_B = str(REPO / "configs" / "llama3_1b.toml")
MOE = str(REPO / "configs" / "debug_moe.toml")
ONE_GPU_MOE = ["--parallelism.expert_parallel_degree", "1"]  # one GPU: no expert parallelism
LOSS = "loss_metrics/global_avg_loss"
FAST = ["--checkpoint.enable", "false", "--metrics.log_freq", "1"]


@dataclass
class Path_:
    name: str
    overrides: list[str]
    what: str
    config: str = DEBUG
    extra_env: dict = field(default_factory=dict)
    expect_rc: int = 0
    expect_line: str = ""  # a substring of the output that must appear
    expect_file: str = ""  # a glob under the dump folder that must match
    positive_tag: str = ""  # a TensorBoard tag that must log a value above 0
    loss_falls: bool = True


PATHS = [
    Path_("eager-bf16", ["--compile.enable", "false"], "bf16 eager, chunked loss, fused AdamW"),
    Path_(
        "compile-zloss",
        ["--compile.enable", "true", "--training.z_loss_weight", "1e-4"],
        "compiled blocks and compiled loss chunks with z-loss",
        expect_line=", z ",
    ),
    Path_(
        "fused-adamw-nan-skip",
        ["--compile.enable", "false"],
        "a NaN loss at step 5: fused AdamW skips it on the device (found_inf)",
        extra_env={"TRAINER_TEST_NAN_LOSS": "0:5"},
        expect_line="skipp",
    ),
    Path_(
        "flex-block-causal",
        ["--model.attn_mask_type", "block_causal", "--model.attn_implementation", "flex"],
        "FlexAttention, one BlockMask per microbatch",
    ),
    Path_(
        "flex-doc-positions",
        [
            "--model.attn_mask_type",
            "block_causal",
            "--model.attn_implementation",
            "flex",
            "--model.positions",
            "document",
            "--compile.enable",
            "true",
        ],
        "FlexAttention + document positions, compiled blocks",
    ),
    Path_(
        "sdpa-gqa",
        ["--compile.enable", "false"],
        "SDPA causal with enable_gqa (debugmodel has 8 heads over 4 KV heads)",
    ),
    Path_(
        "float8-tensorwise",
        ["--float8.enable", "true", "--float8.recipe", "tensorwise", "--compile.enable", "true"],
        "float8 tensorwise (torchao)",
    ),
    Path_(
        "float8-rowwise",
        ["--float8.enable", "true", "--float8.recipe", "rowwise", "--compile.enable", "true"],
        "float8 rowwise (torchao)",
    ),
    Path_(
        "fsdp-cpu-offload",
        ["--parallelism.fsdp_offload", "cpu"],
        "FSDP2 CPU offload (params, grads, optimizer state on the host)",
    ),
    Path_(
        "memory-snapshot",
        ["--profiling.enable_memory_snapshot", "true", "--training.steps", "12"],
        "allocator history snapshot",
        expect_file="memory_snapshot/**/*.pickle",
    ),
    Path_(
        "profiler",
        ["--profiling.enable_profiling", "true", "--profiling.profile_freq", "10"],
        "torch.profiler traces",
        expect_file="profile_traces/**/*.json*",
    ),
    Path_(
        "moe-grouped-bf16",
        [
            *ONE_GPU_MOE,
            "--compile.enable",
            "false",
            "--moe.aux_loss_weight",
            "1e-2",
            "--moe.router_z_loss_weight",
            "1e-3",
        ],
        "debugmodel-moe, bf16 grouped GEMMs (torch._grouped_mm), aux + z losses, balancing",
        config=MOE,
    ),
    Path_(
        "moe-compile",
        [*ONE_GPU_MOE, "--compile.enable", "true"],
        "debugmodel-moe with compiled blocks",
        config=MOE,
    ),
    Path_(
        "moe-capacity",
        [
            *ONE_GPU_MOE,
            "--moe.capacity_factor",
            "1.0",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
        "debugmodel-moe, capacity factor 1 (drops counted) and op-level AC",
        config=MOE,
    ),
    Path_(
        "dsv3-flex-muon-qkclip",
        [
            *ONE_GPU_MOE,
            "--model.attn_mask_type",
            "block_causal",
            "--model.attn_implementation",
            "flex",
            "--optimizer.name",
            "Muon",
            "--optimizer.muon_qk_clip",
            "0.05",
            "--compile.enable",
            "true",
        ],
        "DeepSeek-V3 debug (MLA, MTP): FlexAttention's own logit maxima (AuxRequest) feed "
        "Muon's QK-clip, compiled (tau 0.05: the init's largest logit is ~0.08)",
        config=DSV3,
        positive_tag="qk_clip/heads_clipped",
    ),
    Path_(
        "oom-one-line",
        [
            "--model.flavor",
            "1B",
            "--training.seq_len",
            "4096",
            "--training.local_batch_size",
            "48",
            "--data.dataset",
            "synthetic",
            "--model.vocab_size",
            "128256",
        ],
        "a real CUDA OOM: one line, exit 5",
        expect_rc=5,
        expect_line="CUDA out of memory",
        loss_falls=False,
    ),
]


def run_path(p: Path_, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"gpu_path_{p.name}_") as dump:
        args = ["--job.dump_folder", dump, "--training.steps", str(steps), *FAST, *p.overrides]
        t0 = time.time()
        proc = subprocess.run(
            [str(REPO / "run_train.sh"), *args],
            capture_output=True,
            text=True,
            env=env({"NGPU": "1", "CONFIG_FILE": p.config, "LOG_RANK": "0", **p.extra_env}),
            timeout=900,
        )
        wall = time.time() - t0
        out = proc.stdout + proc.stderr
        losses = [v for _, v in sorted(tb_scalars(dump, LOSS).items())] if p.loss_falls else []
        problems = []
        if proc.returncode != p.expect_rc:
            problems.append(f"exit {proc.returncode}, expected {p.expect_rc}")
        if p.expect_line and p.expect_line not in out:
            problems.append(f"no line with {p.expect_line!r}")
        if p.expect_file and not list(Path(dump).glob(p.expect_file)):
            problems.append(f"no file {p.expect_file}")
        if p.positive_tag and not any(v > 0 for v in tb_scalars(dump, p.positive_tag).values()):
            problems.append(f"no {p.positive_tag} above 0")
        first = last = float("nan")
        if p.loss_falls:
            finite = [x for x in losses if x == x]
            if len(finite) < 10:
                problems.append(f"{len(finite)} finite losses logged")
            else:
                first, last = statistics.mean(finite[:5]), statistics.mean(finite[-5:])
                if not last < first:
                    problems.append(f"loss did not fall ({first:.3f} -> {last:.3f})")
        if problems:
            print(f"--- {p.name}: output tail\n{out[-2500:]}", flush=True)
        for line in out.splitlines():
            if p.expect_line and p.expect_line in line:
                print(f"    {p.name}: {line.strip()[:300]}")
                break
        return {
            "name": p.name,
            "ok": not problems,
            "why": "; ".join(problems),
            "wall": wall,
            "first": first,
            "last": last,
            "n": len(losses),
        }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 25)))
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    chosen = [p for p in PATHS if not args.names or p.name in args.names]
    if args.list or not chosen:
        for p in PATHS:
            print(f"{p.name:<22} {p.what}")
        return 0 if chosen else 2
    rows = []
    for p in chosen:
        print(f"=== {p.name}: {p.what}", flush=True)
        rows.append(run_path(p, args.steps))
        r = rows[-1]
        print(
            f"=== {p.name}: {'ok' if r['ok'] else 'FAILED: ' + r['why']} ({r['wall']:.0f} s)",
            flush=True,
        )
    print(f"\n{'path':<22}{'result':<8}{'loss first5':>12}{'last5':>8}{'logged':>8}{'wall s':>8}")
    for r in rows:
        print(
            f"{r['name']:<22}{'ok' if r['ok'] else 'FAIL':<8}{r['first']:>12.3f}"
            f"{r['last']:>8.3f}{r['n']:>8}{r['wall']:>8.0f}  {r['why']}"
        )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
