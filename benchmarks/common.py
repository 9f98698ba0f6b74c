"""Shared pieces of the benchmark scripts: launching the trainer, reading what it reported,
step-time statistics, and the record appended to benchmarks/results.jsonl.

Benchmarks drive the product the way users do (run_train.sh, TensorBoard scalars, console
lines) so a figure here is a figure a user would see; they are never run by pytest.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results.jsonl"
if str(REPO) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/, not the repo, first
    sys.path.insert(0, str(REPO))


def env(extra: dict | None = None) -> dict:
    """The caller's environment with the repo importable and Hugging Face offline."""
    out = dict(os.environ)
    out.setdefault("HF_DATASETS_OFFLINE", "1")
    out.setdefault("HF_HUB_OFFLINE", "1")
    rest = os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else ""
    out["PYTHONPATH"] = str(REPO) + rest
    out.update(extra or {})
    return out


def run_train(
    dump: str, overrides: list[str], *, ngpu: int, config: str, timeout: float = 1800
) -> tuple[subprocess.CompletedProcess, float]:
    """`NGPU=ngpu CONFIG_FILE=config ./run_train.sh --job.dump_folder dump ...`: (result, wall s).
    Raises with the output's tail when the run fails, since a failed run has no figures."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(REPO / "run_train.sh"), "--job.dump_folder", dump, *overrides],
        env=env({"NGPU": str(ngpu), "CONFIG_FILE": config, "LOG_RANK": "0"}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"run_train.sh exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc, wall


def tb_scalars(dump: str, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard tag written by the trainer under `dump`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for path in sorted(
        glob.glob(os.path.join(dump, "tb", "**", "events.out.tfevents.*"), recursive=True),
        key=os.path.getmtime,
    ):
        acc = EventAccumulator(os.path.dirname(path), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def spread(values: list[float]) -> dict[str, float]:
    """Median, p10 and p90 (nearest rank), min and max of a list of step times."""
    v = sorted(values)

    def pct(q: float) -> float:
        return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]

    return {
        "median": statistics.median(v),
        "p10": pct(0.10),
        "p90": pct(0.90),
        "min": v[0],
        "max": v[-1],
        "n": len(v),
    }


def device_name() -> str:
    """The GPU's name, or the CPU model and the cores this process may use."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(
                line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    return f"{model} ({len(os.sched_getaffinity(0))} cores)"


def git_revision() -> str:
    """HEAD's hash, '+dirty' when tracked files differ from it (figures of uncommitted code)."""

    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return proc.stdout.strip()

    rev = git("rev-parse", "HEAD") or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def relative(value):
    """`value` with every path inside the repository made relative to it (a record must not
    name the machine's checkout)."""
    if isinstance(value, str):
        return value.replace(str(REPO) + os.sep, "")
    if isinstance(value, dict):
        return {k: relative(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [relative(v) for v in value]
    return value


def append_result(record: dict) -> None:
    """One JSON line per benchmark run in benchmarks/results.jsonl, with the environment, if
    the tree is a clean revision (a figure must name the code it measured); paths relative."""
    import torch

    revision = git_revision()
    if revision.endswith("+dirty"):
        print(f"not appended to {RESULTS.relative_to(REPO)}: the tree has uncommitted changes")
        return
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_name(),
        "torch": torch.__version__,
        "git": revision,
        **relative(record),
    }
    with open(RESULTS, "a") as fh:
        fh.write(json.dumps(record, sort_keys=False) + "\n")
    print(f"appended to {RESULTS.relative_to(REPO)}")
