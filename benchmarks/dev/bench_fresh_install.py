"""The README's install on a fresh machine: a new virtualenv made by this Python's own `venv`
and pip, an empty pip cache, then the README's two install commands (the CPU torch, then the
project with its dev extra), each timed. Also counted from pip's own output: the torch wheels
fetched (the one asked for, and no other: a second would mean a dependency's bound pulled
another torch), and pip's backtracking notices ("pip is looking at multiple versions of ..."),
which mean the resolver tried and dropped versions because the bounds disagree.

    python benchmarks/dev/bench_fresh_install.py            # ~2-5 min on 2 cores
    python benchmarks/dev/bench_fresh_install.py --torch 2.11.0
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_WHEEL = re.compile(r"(?:Downloading|Processing|Using cached)\s+\S*?\btorch-(\d[\w.+]*?)-")
BACKTRACK = "pip is looking at multiple versions of"


def pip(python: str, args: list[str], env: dict) -> tuple[float, str]:
    """Seconds and the combined output of `python -m pip install ARGS`; raises on failure."""
    start = time.monotonic()
    proc = subprocess.run(
        [python, "-m", "pip", "install", "--progress-bar", "off", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode:
        sys.exit(f"error: pip install {' '.join(args)} failed:\n{out[-4000:]}")
    return time.monotonic() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--torch", default="2.13.0", help="the torch version the README installs")
    p.add_argument("--keep", action="store_true", help="keep the virtualenv and cache")
    p.add_argument("--log", default="", help="write each pip's output to LOG.<phase>.txt")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="fresh-install-")
    venv, cache = os.path.join(root, "venv"), os.path.join(root, "pip-cache")
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_NO_CACHE_DIR", "VIRTUAL_ENV")}
    env.update(PIP_CACHE_DIR=cache, PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        made = time.monotonic() - start
        python = os.path.join(venv, "bin", "python")
        rows, fetched = [("python -m venv", made, "")], []
        for label, args in (
            (f"pip install torch=={a.torch}", [f"torch=={a.torch}"]),
            (
                'pip install -e ".[dev]" -c constraints.txt',
                ["-e", ".[dev]", "-c", "constraints.txt"],
            ),
        ):
            seconds, out = pip(python, args, env)
            if a.log:
                with open(f"{a.log}.{len(rows)}.txt", "w") as f:
                    f.write(out)
            wheels = TORCH_WHEEL.findall(out)
            fetched += wheels
            notes = out.count(BACKTRACK)
            rows.append((label, seconds, f"torch wheels {wheels or '-'}, backtracking {notes}"))
        total = sum(r[1] for r in rows)
        print(f"fresh install, {sys.version.split()[0]}, {os.cpu_count()} cores, empty pip cache")
        for label, seconds, what in rows:
            print(f"  {label:<44} {seconds:7.1f} s  {what}")
        print(f"  {'total':<44} {total:7.1f} s")
        alone = len(fetched) == 1 and fetched[0].startswith(a.torch)
        print(
            "one torch wheel fetched, the one asked for"
            if alone
            else f"torch wheels fetched: {fetched} (expected only {a.torch})"
        )
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")


if __name__ == "__main__":
    main()
