"""Model FLOPs per token and the peak FLOPS of the device: the two halves of MFU.

MFU = achieved model FLOPs / peak FLOPS, where "model FLOPs" are the matmul FLOPs the model
mathematically needs per token (PaLM, appendix B), not what the kernels happen to execute:

    flops_per_token = 6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len

- ``6 * N_matmul``: every weight that takes part in a matmul costs 2 FLOPs per token forward
  (multiply + add) and 4 backward (grad of the input and grad of the weight). N_matmul counts
  wq, wk, wv, wo, w1, w2, w3 of every block and the output head. It leaves out the token
  embedding (a lookup, not a matmul) and the RMSNorm weights (elementwise).
- ``12 * L * H * hd * S``: per layer and token, the scores q.k^T and the weighted sum of the
  values are each 2 * n_heads * head_dim * seq_len FLOPs forward, and backward costs twice the
  forward. GQA shrinks wk/wv (already in N_matmul through n_kv_heads) but not these products:
  every *query* head still attends over the whole sequence, so they scale with n_heads.
- **Causal masking is counted in full, not as half.** This is the PaLM / torchtitan convention
  (so our MFU is comparable with theirs) and what ``torch.utils.flop_counter.FlopCounterMode``
  counts for SDPA with ``is_causal=True``, which the tests check this formula against. Kernels
  that skip the masked blocks (flash attention) do about half of this attention work, so at long
  sequences this convention reports a somewhat higher MFU than the executed FLOPs would;
  ``attention_flops_per_token(..., causal_half=True)`` gives the other convention.
- Activation-checkpointing recomputation is not model FLOPs and is not counted (standard MFU).
- **block_causal** (`[model] attn_mask_type`) keeps this definition: attention is counted as
  causal over the whole `seq_len` window, so MFU stays comparable between mask types and with
  torchtitan. A block-causal step needs less attention work: the products within each
  document only, sum(len_d^2) / seq_len^2 of the causal figure per window (FlexAttention skips
  the other tiles; CPU SDPA with a mask computes them all and discards them). At long
  sequences with many documents per window the reported MFU therefore overstates the
  executed FLOPs more than under causal; the matmul part (6 * N_matmul) is unchanged.
- **Per device, also under tensor parallelism.** `flops_per_token` is the whole model's; MFU
  and tokens/s are per device. With TP a dp rank's tokens are computed by its tp devices
  (each does ~1/tp of every matmul), so tokens/s per device = a dp rank's tokens/s / tp
  (`tokens_per_device`), and MFU = that * flops_per_token / peak. Work TP repeats on every tp
  rank (norms, the loss without loss parallel) is not model FLOPs and is not counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from trainer.models import registry
from trainer.models.args import ModelArgs


def matmul_params(args: ModelArgs) -> int:
    """Weights used in a matmul for every token: all block Linears plus the output head; in a
    MoE block the router and the experts a token goes through (top_k + shared), not all E."""
    return sum(block_matmul_params(args, i) for i in range(_blocks(args))) + head_matmul_params(
        args
    )


def _blocks(args: ModelArgs) -> int:
    """The blocks the FLOPs count: the layers and the MTP modules'."""
    return args.n_blocks


def block_matmul_params(args: ModelArgs, i: int) -> int:
    """Block `i`'s matmul weights per token: its attention (GQA; a family's own, e.g. MLA, from
    its hooks) and its FFN (the routed experts a token goes through, the router and the shared
    experts; a dense FFN's three matrices); a family with blocks of its own counts them."""
    own = registry.hooks(args).block_matmul_params(args, i)
    if own is not None:  # a family's own block
        return own
    d = args.dim
    q_dim = args.n_heads * args.head_dim
    kv_dim = args.n_kv_heads * args.head_dim
    attention = d * (q_dim + 2 * kv_dim) + q_dim * d
    ffn = args.moe.active_ffn(d) if args.is_moe_layer(i) else 3 * d * args.hidden_dim
    return attention + ffn


def head_matmul_params(args: ModelArgs) -> int:
    """The output head's weights, and each MTP module's projection and head."""
    mtp = args.mtp_layers * (2 * args.dim * args.dim + args.dim * args.vocab_size)
    return args.dim * args.vocab_size + mtp


def block_attention_flops(
    args: ModelArgs, i: int, seq_len: int, causal_half: bool = False
) -> float:
    """Block `i`'s score and value products per token, forward + backward (see the module
    docstring); a family's own mixer instead where it has one (Qwen3-Next's Gated DeltaNet:
    its chunked recurrence)."""
    own = registry.hooks(args).block_attention_flops(args, i, seq_len, causal_half)
    if own is not None:  # a family's own mixer
        return own
    # 2 products (q.k over head_dim channels, p.v over v_head_dim), 2 FLOPs per multiply-add,
    # x3 forward + backward: 12 * heads * head_dim when the two widths agree
    full = 6 * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
    return full / 2 if causal_half else float(full)


def attention_flops_per_token(args: ModelArgs, seq_len: int, causal_half: bool = False) -> float:
    """Score and value products, forward + backward, per token, over every block."""
    return sum(block_attention_flops(args, i, seq_len, causal_half) for i in range(_blocks(args)))


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Forward + backward matmul FLOPs per token; causal attention counted in full."""
    return sum(unit_flops(args, seq_len))


def unit_flops(args: ModelArgs, seq_len: int) -> list[float]:
    """Model FLOPs per token of each unit a pipeline places (trainer/parallel/pp_layout.py):
    [the token embedding, layer 0 .. n - 1, the head]; they sum to `flops_per_token`. The
    embedding is a lookup (0 FLOPs; its memory is the stages' concern, not its work); the
    head is its matmul with the MTP modules that sit beside it (their blocks, projections
    and heads); the loss is elementwise work that model FLOPs do not count."""

    def block(i: int) -> float:
        return 6.0 * block_matmul_params(args, i) + block_attention_flops(args, i, seq_len)

    mtp = sum(block(i) for i in range(args.n_layers, _blocks(args)))
    return [0.0, *(block(i) for i in range(args.n_layers)), 6.0 * head_matmul_params(args) + mtp]


def layer_kind(args: ModelArgs, i: int) -> tuple:
    """What makes block `i` differ in shape from another: MoE or dense FFN, and its mixer
    (its family's kind: Qwen3-Next's Gated DeltaNet or gated attention). Blocks of one kind
    do the same work."""
    return (args.is_moe_layer(i), registry.hooks(args).layer_kind(args, i))


def tokens_per_device(dp_rank_tokens_per_s: float, tp: int = 1) -> float:
    """Tokens/s per device from a dp rank's tokens/s: the rank's tp devices share them."""
    return dp_rank_tokens_per_s / tp


# --------------------------------------------------------------------------- peak FLOPS

# Dense (no structured sparsity) BF16 tensor-core peaks, in TFLOPS, from the vendors' datasheets.
# NVIDIA's datasheets print the "with sparsity" figure for Hopper/Blackwell; dense is half of it.
# Matched in order, case-insensitively, on torch.cuda.get_device_name(): the first row whose
# words all occur as whole words wins (so "GH200" or "A100X" match nothing rather than the wrong
# row), and the specific H100/H200 variants come before the plain ones.
_PEAKS: list[tuple[tuple[str, ...], float, str]] = [
    # NVIDIA A100 datasheet (SXM4 and PCIe, 40/80 GB): BF16 Tensor Core 312 TFLOPS, 624 sparse.
    (("A100",), 312.0, "A100"),
    # NVIDIA H100 datasheet: H100 NVL BF16 Tensor Core 1,671 TFLOPS with sparsity.
    (("H100", "NVL"), 835.5, "H100 NVL"),
    # NVIDIA H100 datasheet: H100 PCIe BF16 Tensor Core 1,513 TFLOPS with sparsity.
    (("H100", "PCIe"), 756.5, "H100 PCIe"),
    # NVIDIA H100 datasheet: H100 SXM BF16 Tensor Core 1,979 TFLOPS with sparsity
    # (the SXM part reports itself as e.g. "NVIDIA H100 80GB HBM3").
    (("H100",), 989.5, "H100 SXM"),
    # NVIDIA H200 datasheet: H200 NVL BF16 Tensor Core 1,671 TFLOPS with sparsity.
    (("H200", "NVL"), 835.5, "H200 NVL"),
    # NVIDIA H200 datasheet: H200 SXM BF16 Tensor Core 1,979 TFLOPS with sparsity.
    (("H200",), 989.5, "H200 SXM"),
    # NVIDIA HGX B200 datasheet: FP16/BF16 Tensor Core 36 PFLOPS with sparsity for 8 GPUs,
    # i.e. 4.5 PFLOPS sparse, 2.25 PFLOPS dense per GPU.
    (("B200",), 2250.0, "B200"),
    # NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS dense, 733 with sparsity.
    (("L40S",), 362.05, "L40S"),
    # AMD Instinct MI300X datasheet: peak BF16 1307.4 TFLOPS dense, 2614.9 with sparsity.
    (("MI300X",), 1307.4, "MI300X"),
]


def table_peak_tflops(device_name: str) -> tuple[float, str] | None:
    """(dense bf16 TFLOPS, table row) for a device name, or None when it is not in the table."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for needles, tflops, row in _PEAKS:
        if all(n.lower() in words for n in needles):
            return tflops, row
    return None


@dataclass(frozen=True)
class Peak:
    """The peak MFU is measured against; `tflops` is None when no honest peak is known."""

    tflops: float | None
    source: str


def resolve_peak(configured_tflops: float, device: torch.device) -> Peak:
    """`[metrics] peak_tflops` if set, else the device table on CUDA, else no peak at all.

    There is no CPU row on purpose: a CPU's bf16 peak depends on the exact SKU, cores, clocks
    and ISA, so we never guess one. On CPU, MFU is reported only against a configured peak.
    """
    if configured_tflops > 0:
        where = "CPU has no device table" if device.type == "cpu" else "overrides the device table"
        return Peak(configured_tflops, f"the config ([metrics] peak_tflops; {where})")
    if device.type != "cuda":
        return Peak(
            None,
            f"none configured: MFU not reported (no peak table for {device.type}; "
            "set [metrics] peak_tflops)",
        )
    name = torch.cuda.get_device_name(device)
    hit = table_peak_tflops(name)
    if hit is None:
        return Peak(
            None,
            f"none configured: MFU not reported ({name!r} is not in the peak "
            "table; set [metrics] peak_tflops)",
        )
    tflops, row = hit
    return Peak(tflops, f"the device table ({row}, dense bf16 datasheet figure; device {name!r})")
