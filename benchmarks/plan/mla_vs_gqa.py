"""What multi-head latent attention costs in memory against grouped-query attention at the same
width, from the memory plan's own formulas (trainer/plan/activations.py, comm.py).

    python benchmarks/plan/mla_vs_gqa.py [--flavor deepseek-v3-671b] [--kv-heads 8] [--tp 1]

The GQA model is the flavor with MLA swapped for Llama-style attention: the same dim and query
heads, head_dim 128, `--kv-heads` key/value heads. Per layer and token, in bf16: the attention's
parameters, what its forward saves for the backward (no activation checkpointing), and what
context parallelism all-gathers (MLA: the latents; GQA: K and V), which is also what an
inference KV cache holds per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.models.flavors import FLAVORS  # noqa: E402
from trainer.plan.activations import block_split  # noqa: E402

P = 2  # bf16


def attention_params(a) -> int:
    if a.mla is not None:
        return a.mla.params(a.dim, a.n_heads)
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return a.dim * (2 * q + 2 * kv)


def attention_saved(a, tp: int) -> int:
    """block_split's attention part: the whole block's bytes minus a dense FFN block's."""
    dense = dataclasses.replace(a, moe=None)
    shard, whole = block_split(dense, P, tp)
    return (
        shard
        + whole
        - 2 * (4 + P) * a.dim
        - 2 * P * a.dim
        - 4 * P * a.hidden_dim // tp
        - 4 * a.n_heads // tp
    )


def gathered(a, tp: int) -> int:
    if a.mla is not None:
        return P * (a.mla.kv_lora_rank + a.mla.qk_rope_head_dim)
    return 2 * P * max(a.n_kv_heads // tp, 1) * a.head_dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="deepseek-v3-671b")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    o = ap.parse_args()
    mla = FLAVORS[o.flavor]
    gqa = dataclasses.replace(mla, mla=None, n_kv_heads=o.kv_heads, explicit_head_dim=128)
    rows = [
        ("attention parameters per layer (M)", lambda a: attention_params(a) / 1e6, "{:.1f}"),
        (
            "saved for backward per token per layer, bf16 (KiB)",
            lambda a: attention_saved(a, o.tp) / 1024,
            "{:.1f}",
        ),
        (
            "all-gathered under CP / KV cache per token per layer (KiB)",
            lambda a: gathered(a, o.tp) / 1024,
            "{:.2f}",
        ),
    ]
    print(
        f"{o.flavor}: dim {mla.dim}, {mla.n_heads} query heads, tp {o.tp}; GQA: head_dim 128, "
        f"{o.kv_heads} KV heads"
    )
    print(f"{'':62s}{'MLA':>10s}{'GQA':>10s}{'MLA/GQA':>10s}")
    for label, fn, fmt in rows:
        m, g = fn(mla), fn(gqa)
        print(f"{label:62s}{fmt.format(m):>10s}{fmt.format(g):>10s}{m / g:>10.2f}")


if __name__ == "__main__":
    main()
