"""Test files' CPU and wall seconds at two revisions, alternated in one run.

    python benchmarks/dev/bench_suite_ab.py --base REV [--head REV] [--repeats 2] FILE [FILE ...]
    python benchmarks/dev/bench_suite_ab.py --base 331f526 tests/test_faults.py tests/test_lease.py

A whole suite does not resolve a change of a few percent on a shared VM: two suites an hour
apart differ by 20% with nothing changed (benchmarks/RESULTS.md). This compares
the files a change touches instead: each revision is cloned from this repository into a
temporary folder, and `python -m pytest -q -n 0 FILES` runs in the base's clone, then the
head's, `--repeats` times (alternating, so a slow spell of the machine falls on both). Each
run's figures are the suite's own (tests/budget.py's per-file lines: setup + call + teardown
seconds and the CPU seconds of pytest's process tree); its time budget is off
(TRAINER_TEST_BUDGET=off). Printed: a row per file, the base's and the head's medians and
their ratio, and the total; a run with a failed test stops the comparison.

Each clone imports its own code: pytest puts the clone's root first on sys.path and
run_train.sh its own folder on PYTHONPATH, ahead of the editable install.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.common import REPO, append_result  # noqa: E402

FILE_LINE = re.compile(r"^\s+([\d.]+) s\s+([\d.]+) CPU-s\s+(\d+) tests\s+(\S+)$", re.M)


def clone(rev: str, into: Path) -> Path:
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(into)], check=True)
    subprocess.run(["git", "-C", str(into), "checkout", "-q", rev], check=True)
    return into


def run_files(root: Path, files: list[str]) -> dict[str, tuple[float, float]]:
    """{file: (wall s, CPU s)} of one `pytest -n 0` of `files` in the clone `root`."""
    env = dict(os.environ, TRAINER_TEST_BUDGET="off")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *files],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"pytest failed in {root} (exit {proc.returncode}):\n{out[-4000:]}")
    found = {m.group(4): (float(m.group(1)), float(m.group(2))) for m in FILE_LINE.finditer(out)}
    missing = [f for f in files if f not in found]
    if missing:
        raise SystemExit(f"no figures for {missing} in the output of {root}:\n{out[-3000:]}")
    return found


def table(files: list[str], runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for f in [*files, "total"]:
        row = {"file": f}
        for side in ("base", "head"):
            per = [
                {**r, "total": tuple(map(sum, zip(*r.values(), strict=True)))}[f]
                for r in runs[side]
            ]
            row[side] = (statistics.median(w for w, _ in per), statistics.median(c for _, c in per))
        row["ratio"] = row["head"][1] / row["base"][1] if row["base"][1] else float("nan")
        rows.append(row)
        print(
            f"{f:45s} wall {row['base'][0]:7.1f} -> {row['head'][0]:7.1f} s   CPU "
            f"{row['base'][1]:7.1f} -> {row['head'][1]:7.1f} s   ({row['ratio']:.2f}x)",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the baseline revision (e.g. a commit)")
    p.add_argument("--head", default="HEAD", help="the revision compared with it")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("files", nargs="+", help="test files, relative to the repository root")
    a = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="suite-ab-") as tmp:
        roots = {
            side: clone(rev, Path(tmp) / side) for side, rev in (("base", a.base), ("head", a.head))
        }
        for i in range(a.repeats):
            for side in ("base", "head"):
                runs[side].append(run_files(roots[side], a.files))
                wall, cpu = map(sum, zip(*runs[side][-1].values(), strict=True))
                print(f"repeat {i + 1} {side}: {wall:.1f} s, {cpu:.1f} CPU-s", flush=True)
    rows = table(a.files, runs)
    append_result(
        {
            "benchmark": "suite_ab",
            "base": a.base,
            "head": a.head,
            "repeats": a.repeats,
            "rows": rows,
            "runs": {side: runs[side] for side in runs},
        }
    )


if __name__ == "__main__":
    main()
