"""SDPA kernels and fused projections at a model's shapes, one op at a time (forward + backward).

    python benchmarks/training/bench_sdpa.py [--flavor 1B] [--batch 7] [--seq 4096] [--repeats 20]

Attention: each SDPA backend this device has (CUDA: cudnn, flash, efficient; CPU: flash,
math) on one layer's causal GQA call, q [b, n_heads, s, hd], k/v [b, n_kv_heads, s, hd] in
bf16 (CPU: float32), `enable_gqa`: the median forward + backward time, and each backend's
output and input gradients against the first one's (max abs difference, and relative to the
reference's largest value). Projections: wq, wk, wv as three matmuls against one fused
[dim, (n_heads + 2 n_kv_heads) hd] matmul, and w1, w3 as two against one [dim, 2 hidden]
(forward + backward, the activation's gradient included): the measurement behind whether a
fused layout pays. Prints one table; CUDA times use events after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import REPO  # noqa: F401  (puts the repo on sys.path)
from trainer.models.flavors import model_args

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of `fn()` after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_rows(a, batch: int, seq: int, dtype, device, repeats: int) -> list[str]:
    g = torch.Generator(device=device).manual_seed(0)
    shape = lambda h: (batch, h, seq, a.head_dim)  # noqa: E731
    q = torch.randn(shape(a.n_heads), generator=g, device=device, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(
            shape(a.n_kv_heads), generator=g, device=device, dtype=dtype, requires_grad=True
        )
        for _ in range(2)
    )
    dout = torch.randn(shape(a.n_heads), generator=g, device=device, dtype=dtype)
    names = ["cudnn", "flash", "efficient"] if device.type == "cuda" else ["flash", "math"]
    rows, ref = [], None
    for name in names:

        def step():
            q.grad = k.grad = v.grad = None
            with sdpa_kernel(BACKENDS[name]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(dout)
            return out

        try:
            out = step()
        except RuntimeError as e:  # this backend does not take the shape or dtype
            rows.append(f"attention {name:<10} not available: {str(e).splitlines()[0][:90]}")
            continue
        got = [out.detach(), q.grad, k.grad, v.grad]
        seconds = timed(step, repeats, device)
        if ref is None:
            ref, ref_s, ref_name = got, seconds, name
            diff = "reference"
        else:
            errs = [
                (x.float() - r.float()).abs().max().item() / r.float().abs().max().item()
                for x, r in zip(got, ref, strict=True)
            ]
            diff = (
                "vs "
                + ref_name
                + ": rel max diff out/dq/dk/dv "
                + "/".join(f"{e:.1e}" for e in errs)
            )
        rows.append(
            f"attention {name:<10} {seconds * 1e3:8.3f} ms  {ref_s / seconds:5.2f}x "
            f"{ref_name}  {diff}"
        )
    return rows


def projection_rows(a, tokens: int, dtype, device, repeats: int) -> list[str]:
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, a.dim, generator=g, device=device, dtype=dtype, requires_grad=True)
    hidden = a.hidden_dim if a.moe is None else None
    groups = {
        "q,k,v": [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
    }
    if hidden:
        groups["w1,w3"] = [hidden, hidden]
    rows = []
    for label, outs in groups.items():
        ws = [
            torch.randn(o, a.dim, generator=g, device=device, dtype=dtype, requires_grad=True)
            for o in outs
        ]
        fused = torch.cat([w.detach() for w in ws]).requires_grad_()

        def split_step():
            x.grad = None
            ys = [x @ w.t() for w in ws]
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])

        def fused_step():
            x.grad = None
            y = x @ fused.t()
            y.backward(torch.ones_like(y))

        s, f = timed(split_step, repeats, device), timed(fused_step, repeats, device)
        rows.append(
            f"projection {label:<8} separate {s * 1e3:8.3f} ms, fused {f * 1e3:8.3f} ms: "
            f"fused saves {100 * (1 - f / s):5.1f}% ({tokens} tokens, out "
            f"{'+'.join(map(str, outs))})"
        )
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="1B")
    ap.add_argument("--batch", type=int, default=7)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = model_args(args.flavor, max_seq_len=args.seq)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"{name} | torch {torch.__version__} | {args.flavor}: {a.n_heads} heads, "
        f"{a.n_kv_heads} kv, head dim {a.head_dim}, batch {args.batch}, seq {args.seq}, "
        f"{str(dtype).split('.')[1]}; forward + backward, median of {args.repeats}"
    )
    for row in attention_rows(a, args.batch, args.seq, dtype, device, args.repeats):
        print(row, flush=True)
    for row in projection_rows(a, args.batch * args.seq, dtype, device, args.repeats):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
