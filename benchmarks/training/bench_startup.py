"""Launch to first step: the debug model on 2 ranks, through run_train.sh (goal <= 15 s here).

    python benchmarks/training/bench_startup.py [--repeats 3] [--ngpu 2] [-- overrides ...]

Two measurements, each repeated (median reported), after one untimed launch that warms the
data cache and the OS's file cache (what a user's second launch sees):
- headline: `run_train.sh --training.steps 1` from launch until rank 0's step-1 console line
  arrives, and until the launcher exits; CPU ranks forked from the launcher (the default) and,
  interleaved with it, started as fresh processes (TRAINER_FORK_RANKS=0), with the CPU seconds
  of the whole process tree;
- breakdown: the launcher run_train.sh runs, but with this file as the worker (the config
  check, which runs inside the launcher before torchrun starts, timed alone and added): it
  wraps trainer.train's setup functions with timers and then runs trainer.train.main
  unchanged. Process start times come from /proc (10 ms resolution).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository


T_SCRIPT = time.time()  # before any heavy import: the worker's interpreter-boot mark
OUT_ENV = "BENCH_STARTUP_OUT"
PHASES = ("init_distributed", "build_dataloader", "build_model", "parallelize")


def process_start_epoch() -> float:
    """This process's start time (epoch seconds) from /proc/self/stat and the boot time."""
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as fh:
        btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def worker(argv: list[str]) -> None:
    """Run trainer.train.main with its setup steps timed; write the marks for this rank."""
    marks = {"process_start": process_start_epoch(), "script_start": T_SCRIPT}
    import trainer.train as tt

    marks["imports_done"] = time.time()

    def timed(name, fn):
        def wrapper(*a, **k):
            if f"{name}_start" not in marks:
                marks[f"{name}_start"] = time.time()
                try:
                    return fn(*a, **k)
                finally:
                    marks[f"{name}_end"] = time.time()
            return fn(*a, **k)

        return wrapper

    for name in PHASES:
        setattr(tt, name, timed(name, getattr(tt, name)))
    from trainer.step import TrainStep

    TrainStep.__call__ = timed("train_step", TrainStep.__call__)  # the first step
    rc = tt.main(argv)
    with open(os.path.join(os.environ[OUT_ENV], f"rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(marks, fh)
    sys.stdout.flush()
    os._exit(rc)  # as trainer.train does: gloo threads can abort interpreter teardown


def headline(overrides: list[str], ngpu: int, fork: bool = True) -> dict[str, float]:
    """run_train.sh from launch to the step-1 line, and to exit; CPU seconds of all processes."""
    from benchmarks.common import REPO, env

    with tempfile.TemporaryDirectory(prefix="bench_startup_") as dump:
        cpu0, t0 = os.times(), time.time()
        proc = subprocess.Popen(
            [
                str(REPO / "run_train.sh"),
                "--job.dump_folder",
                dump,
                "--training.steps",
                "1",
                *overrides,
            ],
            env=env(
                {"NGPU": str(ngpu), "LOG_RANK": "0", "TRAINER_FORK_RANKS": "1" if fork else "0"}
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        first = None
        for line in proc.stdout:
            if first is None and line.lstrip().startswith("step:"):
                first = time.time() - t0
        rc, end, cpu1 = proc.wait(), time.time() - t0, os.times()
    if rc != 0 or first is None:
        raise SystemExit(f"run_train.sh exited {rc} (step line seen: {first is not None})")
    cpu = (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system)
    return {"to_first_step": first, "to_exit": end, "cpu_s": cpu}


# run_train.sh's config check inside the launcher (trainer.launch --check), timed alone: what it
# adds to a launcher that has imported torch already
CHECK = (
    "import sys, time, trainer.launch as L; t = time.time(); "
    "assert not isinstance(L.check_first(sys.argv[1:]), int); print(time.time() - t)"
)


def breakdown(overrides: list[str], ngpu: int) -> dict[str, float]:
    """run_train.sh's launcher with this file as the worker; seconds per stage (the config
    check, which runs in the launcher, timed in a process of its own and added)."""
    from benchmarks.common import REPO, env

    config = str(REPO / "configs" / "debug_model.toml")
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as dump:
        args = [
            "--job.config_file",
            config,
            "--job.dump_folder",
            dump,
            "--training.steps",
            "1",
            *overrides,
        ]
        e = env(
            {"LOG_RANK": "0", OUT_ENV: dump, "OMP_NUM_THREADS": str(max(1, os.cpu_count() // ngpu))}
        )
        check = subprocess.run(
            [
                sys.executable,
                "-c",
                CHECK,
                "--nnodes",
                "1",
                "--nproc_per_node",
                str(ngpu),
                "-m",
                "trainer.train",
                *args,
            ],
            env=e,
            check=True,
            capture_output=True,
            text=True,
        )
        t_check = time.time()  # the launcher starts: as if after the check, which began at t0
        t0 = t_check - float(check.stdout.split()[-1])
        subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer.launch",
                "--nnodes",
                "1",
                "--nproc_per_node",
                str(ngpu),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                "localhost:0",
                __file__,
                "--worker",
                *args,
            ],
            env=e,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with open(os.path.join(dump, "rank0.json")) as fh:
            m = json.load(fh)
    stages = {
        "config check (in the launcher)": t_check - t0,
        "launcher to worker process": m["process_start"] - t_check,
        "interpreter boot": m["script_start"] - m["process_start"],
        "imports (torch, trainer)": m["imports_done"] - m["script_start"],
        "process group": m["init_distributed_end"] - m["init_distributed_start"],
        "mesh + data loader": m["build_dataloader_end"] - m["init_distributed_end"],
        "model build (meta)": m["build_model_end"] - m["build_model_start"],
        "parallelize (FSDP, init)": m["parallelize_end"] - m["parallelize_start"],
        "optimizer, metrics, checkpoint": m["train_step_start"] - m["parallelize_end"],
        "first step": m["train_step_end"] - m["train_step_start"],
    }
    stages["between the stages above"] = m["train_step_end"] - t0 - sum(stages.values())
    stages["total to first step"] = m["train_step_end"] - t0
    return stages


def median_of(runs: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
    from benchmarks.common import append_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ngpu", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("overrides", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    overrides = ["--checkpoint.enable", "false", *[x for x in a.overrides if x != "--"]]
    headline(overrides, a.ngpu)  # warm-up: data cache, file cache
    heads, fresh, parts = [], [], []
    for _ in range(a.repeats):  # alternate the kinds of run
        heads.append(headline(overrides, a.ngpu))
        fresh.append(headline(overrides, a.ngpu, fork=False))
        parts.append(breakdown(overrides, a.ngpu))
    h, f, b = median_of(heads), median_of(fresh), median_of(parts)
    for name, m, runs in (
        ("forked ranks (default)", h, heads),
        ("fresh processes (TRAINER_FORK_RANKS=0)", f, fresh),
    ):
        print(
            f"run_train.sh, {a.ngpu} ranks, {name}, median of {a.repeats} (after a warm-up "
            f"launch): launch -> step 1 line {m['to_first_step']:.2f} s (goal <= 15 s); "
            f"-> exit {m['to_exit']:.2f} s; CPU {m['cpu_s']:.1f} s; runs: "
            + ", ".join(f"{r['to_first_step']:.2f}" for r in runs)
        )
    print("breakdown (instrumented worker script, so fresh processes; medians):")
    for stage, s in b.items():
        print(f"  {stage:<34} {s:6.2f} s")
    if not a.no_record:
        append_result(
            {
                "bench": "startup",
                "ngpu": a.ngpu,
                "overrides": overrides,
                "repeats": a.repeats,
                "headline_s": h,
                "runs": heads,
                "fresh_processes_s": f,
                "fresh_runs": fresh,
                "breakdown_s": b,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
