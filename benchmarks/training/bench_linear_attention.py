"""One Gated DeltaNet layer (trainer/models/qwen3_next/model.py) against one GQA layer
(trainer/models/common/decoder.py's Attention) at the same width: forward + backward, tokens/s and
the memory each keeps for its backward, side by side.

    python benchmarks/training/bench_linear_attention.py [--seqs 1024 4096] [--dim 512]
        [--device cpu]

Both layers run alone (no norm, no FFN) on a [1, seq, dim] input in fp32 (bf16 with
`--dtype bfloat16`, for GPUs). GQA: dim / 64 heads of 64, a quarter as many KV heads, causal
SDPA. Gated DeltaNet: Qwen3-Next's proportions at this width (dim / 128 key heads and twice as
many value heads, both of 64 channels, a 4-tap convolution), on the kernel `kernel_name` names
(the torch chunked form on CPU). "saved" is the bytes of the distinct tensors autograd keeps for
the backward (weights excluded); on CUDA "peak" is the allocator's peak over the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from trainer.models.args import ModelArgs  # noqa: E402
from trainer.models.common.decoder import Attention  # noqa: E402
from trainer.models.common.layers import rope_tables  # noqa: E402
from trainer.models.qwen3_next.args import HybridArgs  # noqa: E402
from trainer.models.qwen3_next.deltanet import kernel_name  # noqa: E402
from trainer.models.qwen3_next.model import Qwen3Next  # noqa: E402


def layers(dim: int):
    """(GQA layer, Gated DeltaNet layer, the GQA's RoPE head_dim), weights drawn as our init."""
    heads = dim // 64
    gqa_args = ModelArgs(
        dim=dim, n_layers=1, n_heads=heads, n_kv_heads=max(heads // 4, 1), vocab_size=256
    )
    hybrid = HybridArgs(
        layer_types=("linear_attention",),
        linear_k_heads=max(dim // 128, 1),
        linear_v_heads=2 * max(dim // 128, 1),
        linear_k_head_dim=64,
        linear_v_head_dim=64,
    )
    model = Qwen3Next(
        ModelArgs(
            dim=dim,
            n_layers=1,
            n_heads=heads,
            n_kv_heads=1,
            vocab_size=256,
            max_seq_len=8,
            hybrid=hybrid,
        )
    )
    model.init_weights(seed=0)
    gqa = Attention(gqa_args)
    for p in gqa.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return gqa, model.layers["0"].linear_attention, gqa_args.head_dim


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """fn()'s output and the bytes of the distinct non-parameter tensors saved for backward."""
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def measure(run, x, device: str, reps: int) -> tuple[float, int, int]:
    """(median seconds per forward + backward, saved bytes, CUDA peak bytes or 0)."""
    times, saved, peak = [], 0, 0
    for i in range(reps + 1):  # the first is a warm-up
        x.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out, saved = saved_bytes(lambda: run(x))
        out.float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), saved, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    gqa, gdn, head_dim = layers(a.dim)
    gqa, gdn = gqa.to(a.device, dtype), gdn.to(a.device, dtype)
    print(
        f"dim {a.dim}, {a.device} {a.dtype}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}; Gated DeltaNet kernel: {kernel_name(a.device)}"
    )
    print(f"{'seq':>7} {'layer':<15} {'tokens/s':>10} {'ms':>9} {'saved MiB':>10} {'peak MiB':>9}")
    for seq in a.seqs:
        x = torch.randn(1, seq, a.dim, device=a.device, dtype=dtype, requires_grad=True)
        cos, sin = rope_tables(head_dim, seq, 500000.0, device=a.device)
        runs = {"GQA (SDPA)": lambda t: gqa(t, cos, sin), "Gated DeltaNet": gdn}
        for name, run in runs.items():
            sec, saved, peak = measure(run, x, a.device, a.reps)
            print(
                f"{seq:>7} {name:<15} {seq / sec:>10.0f} {sec * 1e3:>9.1f} "
                f"{saved / 2**20:>10.1f} {peak / 2**20 if peak else float('nan'):>9.1f}"
            )


if __name__ == "__main__":
    main()
