"""Mixture of experts on the CPU, side by side in one run:

1. the experts' grouped GEMM (`torch._grouped_mm`) against the per-expert loop, forward +
   backward, at the debugmodel-moe layer's shape and at a Qwen3-30B-A3B layer's shape (128
   experts of 768, dim 2048, top 8) with fewer tokens;
2. one training step (forward + backward, fp32, chunked loss) of debugmodel-moe against a dense
   model of the same active parameters (debugmodel-moe's shape with every block dense and the
   FFN width that matches top_k experts + the router).

    python benchmarks/parallel/bench_moe.py [--tokens 2048] [--repeats 5] [--device cuda
        --dtype bfloat16]
        [--layer-tokens 16384]

With `--float8` it also times the experts' GEMMs in rowwise float8 (`float8.moe`,
trainer/parallel/float8_moe.py) beside the same experts in `--dtype`, forward + backward, with
the relative error of the outputs and input gradients (on the CPU the float8 GEMM is emulated:
the error is what a GPU gives, the time is not).

With `--layer-tokens N` it also times one whole Qwen3-30B-A3B MoE layer (router, top-8 of 128,
grouped experts, combine; forward + backward) over N tokens and prints its TFLOP/s.

Medians of `--repeats` after one warm-up; one process (the all-to-all of expert parallelism is
exercised by tests/test_moe.py, not timed here). On CUDA (when a GPU is lent) the same script
runs on the GPU with `--device cuda`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from trainer.models.build import build_model
from trainer.models.common.loss import build_loss
from trainer.models.common.moe import GroupedExperts
from trainer.models.flavors import FLAVORS


def timed(fn, repeats: int, device: str) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def experts_case(
    n_experts: int,
    dim: int,
    hidden: int,
    rows: int,
    repeats: int,
    device: str,
    dtype: torch.dtype = torch.float32,
):
    """(grouped s, loop s) for forward + backward over `rows` routed rows, balanced-ish."""
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(dim, hidden, n_experts).to(device, dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    choice = torch.randint(0, n_experts, (rows,), generator=gen).sort().values
    counts = torch.bincount(choice, minlength=n_experts).to(device)
    x = torch.randn(rows, dim, generator=gen).to(device, dtype).requires_grad_()
    out = {}
    for grouped in (True, False):
        experts.grouped = grouped

        def step():
            experts(x, counts).square().mean().backward()

        try:
            out[grouped] = timed(step, repeats, device)
        except (RuntimeError, NotImplementedError) as e:  # e.g. a dtype the kernel lacks
            print(f"  {'grouped' if grouped else 'loop'} failed: {str(e).splitlines()[0][:200]}")
            out[grouped] = float("nan")
    return out[True], out[False]


def float8_case(
    n_experts: int, dim: int, hidden: int, rows: int, repeats: int, device: str, dtype: torch.dtype
) -> None:
    """The experts in `dtype` against float8 experts (emulated off CUDA), forward + backward."""
    from trainer.parallel.float8_moe import Float8GroupedExperts

    gen = torch.Generator().manual_seed(0)
    base = GroupedExperts(dim, hidden, n_experts).to(device, dtype)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * dim**-0.5)
    f8 = GroupedExperts(dim, hidden, n_experts).to(device, dtype)
    f8.load_state_dict(base.state_dict())
    f8.__class__, f8.emulate = Float8GroupedExperts, device != "cuda"
    choice = torch.randint(0, n_experts, (rows,), generator=gen).sort().values
    counts = torch.bincount(choice, minlength=n_experts).to(device)
    x = torch.randn(rows, dim, generator=gen).to(device, dtype)
    dy = torch.randn(rows, dim, generator=gen).to(device, dtype)
    results = {}
    for name, experts in (("base", base), ("float8", f8)):
        xx = x.clone().requires_grad_()

        def step():
            xx.grad = None
            (experts(xx, counts) * dy).sum().backward()

        results[name] = (timed(step, repeats, device), experts(xx, counts).float(), xx.grad.float())
    (tb, yb, gb), (tf, yf, gf) = results["base"], results["float8"]
    flops = 6 * 3 * rows * dim * hidden
    print(
        f"  float8 experts ({n_experts} of {hidden}, dim {dim}, {rows} rows): {dtype} "
        f"{tb * 1e3:7.1f} ms ({flops / tb / 1e12:6.1f} TFLOP/s), float8"
        f"{' (emulated)' if device != 'cuda' else ''} {tf * 1e3:7.1f} ms "
        f"({flops / tf / 1e12:6.1f} TFLOP/s), {tb / tf:4.2f}x; rel. error out "
        f"{((yf - yb).norm() / yb.norm()).item():.3f}, dx "
        f"{((gf - gb).norm() / gb.norm()).item():.3f}"
    )


def layer_case(tokens: int, repeats: int, device: str, dtype: torch.dtype) -> None:
    """One Qwen3-30B-A3B MoE layer, forward + backward over `tokens` tokens: time and TFLOP/s."""
    from trainer.models.common.moe import MoE

    args = FLAVORS["qwen3-30b-a3b"]
    m = args.moe
    layer = MoE(args.dim, m).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    layer.to(dtype)
    x = torch.randn(tokens, args.dim, generator=gen, device=device).to(dtype).requires_grad_()
    for grouped in (True, False):
        layer.experts.grouped = grouped

        def step():
            layer(x).square().mean().backward()
            layer.take_stats()

        try:
            t = timed(step, repeats, device)
        except (RuntimeError, NotImplementedError) as e:
            print(
                f"  Qwen3-30B-A3B layer ({'grouped' if grouped else 'loop'}) failed: "
                f"{str(e).splitlines()[0][:200]}"
            )
            continue
        # 3 matmuls of dim x hidden per routed row, x3 for forward + backward, + the router.
        flops = 6 * tokens * (m.top_k * 3 * args.dim * m.hidden_dim + args.dim * m.n_experts)
        print(
            f"  Qwen3-30B-A3B MoE layer, {tokens} tokens ({dtype}, "
            f"{'grouped' if grouped else 'loop'}): {t * 1e3:8.1f} ms fwd+bwd, "
            f"{flops / t / 1e12:6.1f} TFLOP/s, {tokens / t:,.0f} tokens/s"
        )


def step_time(
    args, tokens: int, repeats: int, device: str, dtype: torch.dtype = torch.float32
) -> float:
    model = build_model(args)
    model.to_empty(device=device)
    model.init_weights(0)
    model.to(dtype)
    model.train()
    loss_fn = build_loss("chunked", 1024)
    gen = torch.Generator().manual_seed(0)
    seq = 256
    inputs = torch.randint(0, args.vocab_size, (tokens // seq, seq), generator=gen).to(device)

    def step():
        model(inputs, labels=inputs, loss_fn=loss_fn).backward()
        for layer in model.modules():  # drop the MoE statistics and aux terms each step
            if hasattr(layer, "take_stats"):
                layer.take_stats()

    return timed(step, repeats, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--float8", action="store_true", help="also time the experts in rowwise float8 (float8.moe)"
    )
    ap.add_argument(
        "--layer-tokens",
        type=int,
        default=0,
        help="also time a whole Qwen3-30B-A3B MoE layer over this many tokens",
    )
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    moe_args = dataclasses.replace(FLAVORS["debugmodel-moe"], max_seq_len=256)
    m = moe_args.moe
    print(f"grouped GEMM vs per-expert loop, forward + backward ({a.device}, {a.dtype})")
    for name, (e, dim, hidden, rows) in {
        "debugmodel-moe layer": (m.n_experts, moe_args.dim, m.hidden_dim, a.tokens * m.top_k),
        "Qwen3-30B-A3B layer": (128, 2048, 768, a.tokens * 8 // 8),
    }.items():
        grouped, loop = experts_case(e, dim, hidden, rows, a.repeats, a.device, dtype)
        print(
            f"  {name:22} {e:4d} experts, {rows:6d} rows: grouped {grouped * 1e3:8.1f} ms, "
            f"loop {loop * 1e3:8.1f} ms, loop / grouped {loop / grouped:5.2f}x"
        )
    if a.float8:
        float8_case(128, 2048, 768, a.tokens * 8, a.repeats, a.device, dtype)  # Qwen3-30B-A3B
        float8_case(32, 7168, 2048, a.tokens * 8 // 8, a.repeats, a.device, dtype)  # DSV3, EP 8
    if a.layer_tokens:
        layer_case(a.layer_tokens, a.repeats, a.device, dtype)
    # A dense model with the MoE's active FFN: top_k experts of hidden + the router's E x dim.
    active_hidden = m.top_k * m.hidden_dim + round(m.n_experts / 3)
    dense_args = dataclasses.replace(
        moe_args,
        moe=None,
        multiple_of=1,
        ffn_dim_multiplier=active_hidden / int(2 * 4 * moe_args.dim / 3),
    )
    active_moe, active_dense = moe_args.num_params(active=True), dense_args.num_params()
    t_moe = step_time(moe_args, a.tokens, a.repeats, a.device, dtype)
    t_dense = step_time(dense_args, a.tokens, a.repeats, a.device, dtype)
    print(f"training step, {a.tokens} tokens ({a.dtype}, forward + backward, {a.device}):")
    print(
        f"  debugmodel-moe  {active_moe / 1e6:6.2f}M active of "
        f"{moe_args.num_params() / 1e6:6.2f}M: {t_moe * 1e3:8.1f} ms"
    )
    print(
        f"  dense (FFN {dense_args.hidden_dim}) {active_dense / 1e6:6.2f}M: "
        f"{t_dense * 1e3:8.1f} ms   moe / dense {t_moe / t_dense:5.2f}x"
    )


if __name__ == "__main__":
    main()
