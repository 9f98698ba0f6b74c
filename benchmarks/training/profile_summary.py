"""Where the GPU time of one traced step goes, from a `[profiling]` chrome trace.

    python benchmarks/training/profile_summary.py \
        DUMP/profile_traces/iteration_N/rank0_trace.json [--top 25]

Prints the step's wall time (first to last GPU kernel), the time the GPU was busy (union of
kernel intervals) and idle, the kernel time by category (matmuls, attention, triton fusions,
optimizer, copies/casts, collectives, other) and the top kernels by total time. Kernel
categories come from kernel names, so they are a reading aid, not an exact accounting.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

CATEGORIES = [  # (category, substrings of a kernel's name), first match wins
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "wgmma", "matmul", "grouped_mm")),
    ("optimizer", ("multi_tensor", "fused_adam", "adam")),
    ("collective", ("nccl",)),
    ("triton", ("triton",)),
    ("copy/cast", ("copy", "cast", "memcpy", "memset", "fill", "cat", "chunk")),
    ("reduction", ("reduce", "softmax", "norm", "sum", "max")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other elementwise"


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


def busy_us(kernels: list[dict]) -> float:
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    kernels = load(a.trace)
    if not kernels:
        raise SystemExit(f"no GPU kernels in {a.trace}")
    wall = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    busy = busy_us(kernels)
    print(
        f"kernels: {len(kernels)}; span {wall / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms "
        f"({100 * busy / wall:.1f}%), idle {(wall - busy) / 1e3:.1f} ms"
    )
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        by_cat[category(k["name"])] += k["dur"]
        by_name[k["name"]][0] += k["dur"]
        by_name[k["name"]][1] += 1
    total = sum(by_cat.values())
    print(f"\n{'category':<20}{'ms':>10}{'%':>7}")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"{cat:<20}{us / 1e3:>10.1f}{100 * us / total:>7.1f}")
    print(f"\n{'ms':>9}{'calls':>7}  kernel (top {a.top})")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"{us / 1e3:>9.2f}{n:>7}  {name[:110]}")


if __name__ == "__main__":
    main()
