"""CPU: peak tensor memory and time of the eager vs chunked loss (forward + backward), fp32.

    python benchmarks/training/bench_loss.py [--tokens 4096] [--dim 2048] [--vocab 32768]
        [--chunk 1024]

Peak memory is torch's MemTracker peak (every tensor the allocator holds), minus the inputs.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from trainer.models.common.loss import build_loss

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--dim", type=int, default=2048)
ap.add_argument("--vocab", type=int, default=32768)
ap.add_argument("--chunk", type=int, default=1024)
ap.add_argument("--repeats", type=int, default=3)
a = ap.parse_args()
gen = torch.Generator().manual_seed(0)
h = torch.randn(a.tokens, a.dim, generator=gen).requires_grad_()
w = (torch.randn(a.vocab, a.dim, generator=gen) * 0.02).requires_grad_()
y = torch.randint(0, a.vocab, (a.tokens,), generator=gen)
for kind in ("eager", "chunked"):
    fn = build_loss(kind, a.chunk)
    times = []
    for _ in range(a.repeats):
        h.grad = w.grad = None
        t0 = time.perf_counter()
        fn(h, w, y).backward()
        times.append(time.perf_counter() - t0)
    h.grad = w.grad = None
    tracker = MemTracker()
    with tracker:
        fn(h, w, y).backward()
    snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    peak = next(v for k, v in snap.items() if str(getattr(k, "value", k)) == "Total") / 2**20
    print(
        f"{kind:8} tokens {a.tokens} dim {a.dim} vocab {a.vocab} chunk {a.chunk}: "
        f"peak {peak:8.1f} MiB (incl. inputs+grads), median {sorted(times)[len(times) // 2]:.2f} s"
    )
