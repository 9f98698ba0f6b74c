"""Mixture of experts on the CPU, side by side in one run:

1. the experts' grouped GEMM (`torch._grouped_mm`) against the per-expert loop, forward +
   backward, at the debugmodel-moe layer's shape and at a Qwen3-30B-A3B layer's shape (128
   experts of 768, dim 2048, top 8) with fewer tokens;
2. one training step (forward + backward, fp32, chunked loss) of debugmodel-moe against a dense
   model of the same active parameters (debugmodel-moe's shape with every block dense and the
   FFN width that matches top_k experts + the router).

    python benchmarks/bench_moe.py [--tokens 2048] [--repeats 5]

Medians of `--repeats` after one warm-up; one process (the all-to-all of expert parallelism is
exercised by tests/test_moe.py, not timed here). On CUDA (when a GPU is lent) the same script
runs on the GPU with `--device cuda`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from trainer.models.args import FLAVORS, MoEArgs
from trainer.models.llama import build_model
from trainer.models.loss import build_loss
from trainer.models.moe import GroupedExperts


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


def experts_case(n_experts: int, dim: int, hidden: int, rows: int, repeats: int, device: str):
    """(grouped s, loop s) for forward + backward over `rows` routed rows, balanced-ish."""
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(dim, hidden, n_experts).to(device)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    choice = torch.randint(0, n_experts, (rows,), generator=gen).sort().values
    counts = torch.bincount(choice, minlength=n_experts).to(device)
    x = torch.randn(rows, dim, generator=gen).to(device).requires_grad_()
    out = {}
    for grouped in (True, False):
        experts.grouped = grouped

        def step():
            experts(x, counts).square().mean().backward()
        out[grouped] = timed(step, repeats, device)
    return out[True], out[False]


def step_time(args, tokens: int, repeats: int, device: str) -> float:
    model = build_model(args)
    model.to_empty(device=device)
    model.init_weights(0)
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
    a = ap.parse_args()
    torch.manual_seed(0)
    moe_args = dataclasses.replace(FLAVORS["debugmodel-moe"], max_seq_len=256)
    m = moe_args.moe
    print(f"grouped GEMM vs per-expert loop, forward + backward ({a.device}, fp32)")
    for name, (e, dim, hidden, rows) in {
            "debugmodel-moe layer": (m.n_experts, moe_args.dim, m.hidden_dim,
                                     a.tokens * m.top_k),
            "Qwen3-30B-A3B layer": (128, 2048, 768, a.tokens * 8 // 8)}.items():
        grouped, loop = experts_case(e, dim, hidden, rows, a.repeats, a.device)
        print(f"  {name:22} {e:4d} experts, {rows:6d} rows: grouped {grouped * 1e3:8.1f} ms, "
              f"loop {loop * 1e3:8.1f} ms, loop / grouped {loop / grouped:5.2f}x")
    # A dense model with the MoE's active FFN: top_k experts of hidden + the router's E x dim.
    active_hidden = m.top_k * m.hidden_dim + round(m.n_experts / 3)
    dense_args = dataclasses.replace(moe_args, moe=None, multiple_of=1,
                                     ffn_dim_multiplier=active_hidden / int(2 * 4 * moe_args.dim
                                                                            / 3))
    active_moe, active_dense = moe_args.num_params(active=True), dense_args.num_params()
    t_moe = step_time(moe_args, a.tokens, a.repeats, a.device)
    t_dense = step_time(dense_args, a.tokens, a.repeats, a.device)
    print(f"training step, {a.tokens} tokens (fp32, forward + backward, {a.device}):")
    print(f"  debugmodel-moe  {active_moe / 1e6:6.2f}M active of "
          f"{moe_args.num_params() / 1e6:6.2f}M: {t_moe * 1e3:8.1f} ms")
    print(f"  dense (FFN {dense_args.hidden_dim}) {active_dense / 1e6:6.2f}M: "
          f"{t_dense * 1e3:8.1f} ms   moe / dense {t_moe / t_dense:5.2f}x")


if __name__ == "__main__":
    main()
