"""The hybrid blocks of Qwen3-Next and Qwen3.5 (trainer/models/qwen3_next.py) in the memory
plan: what a Gated DeltaNet layer and a gated attention layer save for backward, per token,
counted from what the eager model and the torch chunked kernel (trainer/models/deltanet.py)
keep, in the compute dtype p (bf16) with fp32 inside the kernel; tests/test_plan_qwen3_next.py
checks them against the tensors autograd saves at a small shape.

Per token, with K = linear_k_heads x d_k and V = linear_v_heads x d_v the key and value widths,
h the value heads (q and k are repeated to them inside the kernel), c = 64 the chunk and
n = tokens / c the chunks of a sequence, all heads 1/tp under tensor parallelism:

- **Gated DeltaNet**: the projections' input (p x dim, once for wq, wk, wv, wz, wa, wb); per
  convolved stream (q, k: K wide, v: V wide) the projection's output, the convolution's padded
  input and its output before SiLU (3 p); the gated output norm's normed output, its weighted
  product and wo's input (3 p x V); beta (p x h). In the kernel (fp32): ten [h, d_k] tensors
  (q and k upcast, L2-normed and scaled, k x beta, the WY matrix W, q and k times their
  decays, two transposed copies for the batched matmuls) and, per chunk of the state loop, two
  more [c, d_k] copies (2 - 1/n of [h, d_k] per token); six [h, d_v] tensors (v upcast, the
  UT solve's U, the corrected values V' of every chunk, the output norm's upcast input, z
  upcast and its SiLU); five [h, c] chunk matrices (the decays
  exp(G_i - G_j), K_beta K^T, the solved system, Q K^T and its decayed form); the state
  entering every chunk, [h, d_k, d_v] per c tokens (d_k d_v / c per token and head: 4x the
  [h, d_k] terms at the releases' d = 128); eight fp32 per-head scalars (the decay's
  softplus and gate, beta and g upcast, the chunk decays in and out, the two L2 norms'
  rsqrt). Under block_causal: the [c, c] same-document mask per token and the decays masked
  at the documents' edges (2 x 4 h), a byte per token for each convolution tap's mask.
- **Gated attention** (GQA with q/k norms, partial RoPE, a sigmoid output gate): the
  projections' input (p x dim); q and k's zero-centred norms (fp32 upcast and normed output,
  8 bytes per channel, and an fp32 rsqrt per head); the rotated q and k, v, SDPA's output
  (as [tokens, Q]) and logsumexp (fp32 per head); the gate's sigmoid and the gated product
  (wo's input): (8 + 4 p) Q + (8 + 2 p) KV + 8 heads + 4 kv heads.
- **Norms**: each zero-centred RMSNorm keeps the fp32 upcast and the fp32 normed input and
  its rsqrt (8 x dim + 4), on 1/tp of the sequence; its output is its consumer's input.
- **Feed-forward**: the norm's output (p x dim), then the routed experts as
  trainer/plan/moe.py counts them, the sigmoid-gated shared expert (its SwiGLU's four hidden
  tensors, its output and the gate: 4 p x hidden + p x dim + p), or a dense SwiGLU.

fla-core's Triton kernel on CUDA keeps far less (q, k, v, g, beta and the chunks' [c, c]
matrices; it recomputes the states in backward): for it the kernel's terms are an upper bound.
Context parallelism's split DeltaNet also runs each piece's state transition (with d_k more
value columns) and is not modelled beyond these terms.
"""

from __future__ import annotations

from trainer.models.args import ModelArgs
from trainer.plan.moe import moe_ffn_bytes

FP32, CHUNK = 4, 64


def norm_bytes(dim: int) -> int:
    """A zero-centred RMSNorm: the fp32 upcast, the fp32 normed input, the rsqrt."""
    return 2 * FP32 * dim + FP32


def deltanet_bytes(
    a: ModelArgs, p: int, tokens: int, tp: int = 1, documents: bool = False
) -> float:
    """Per token, what one Gated DeltaNet layer's mixer saves (see the module docstring) for a
    sequence of `tokens` (this rank's: the chunks n = tokens / 64)."""
    h = a.hybrid
    keys, values, heads = h.keys // tp, h.values // tp, h.linear_v_heads // tp
    dk, dv, c = h.linear_k_head_dim, h.linear_v_head_dim, CHUNK
    chunks = max(-(-tokens // c), 1)
    kernel = (
        FP32 * heads * (12 * dk + 6 * dv + 5 * c + dk * dv / c + 8) - FP32 * heads * dk / chunks
    )
    eager = p * a.dim + 6 * p * keys + 6 * p * values + p * heads
    docs = c + 2 * FP32 * heads + 3 * (h.conv_kernel - 1) + 2 if documents else 0
    return eager + kernel + docs


def gated_attention_bytes(a: ModelArgs, p: int, tp: int = 1) -> int:
    """Per token, what one gated attention layer saves (see the module docstring)."""
    q, kv = a.n_heads * a.head_dim // tp, a.n_kv_heads * a.head_dim // tp
    heads, kv_heads = a.n_heads // tp, max(a.n_kv_heads // tp, 1)
    return p * a.dim + (8 + 4 * p) * q + (8 + 2 * p) * kv + 8 * heads + 4 * kv_heads


def ffn_bytes(a: ModelArgs, p: int, moe: bool, tp: int = 1, ep: int = 1) -> int:
    """Per token, what a hybrid block's feed-forward saves after its norm: the routed MoE
    (trainer/plan/moe.py) with the gated shared expert, or a dense SwiGLU (1/tp wide)."""
    if not moe:
        return p * a.dim + 4 * p * a.hidden_dim // tp
    hs = a.hybrid.shared_expert_hidden
    shared = 4 * p * hs + p * a.dim + p if hs else 0
    return p * a.dim + moe_ffn_bytes(a, p, ep) + shared


def block_split(
    a: ModelArgs, layer: int, p: int, tokens: int, tp: int = 1, ep: int = 1, documents: bool = False
) -> tuple[float, float]:
    """Block `layer`'s saved bytes per token, no AC, as (per token of this rank's sequence
    shard, per token of the whole microbatch), like trainer.plan.activations.block_split:
    the norms and a MoE feed-forward on the sequence shard, the mixer (and a dense SwiGLU)
    on the whole sequence with 1/tp of the heads."""
    moe = a.is_moe_layer(layer)
    linear = a.hybrid.layer_type(layer) != "full_attention"
    mixer = (
        deltanet_bytes(a, p, tokens, tp, documents) if linear else gated_attention_bytes(a, p, tp)
    )
    ffn = ffn_bytes(a, p, moe, tp, ep)
    shard = 2 * norm_bytes(a.dim) + (ffn if moe else 0)
    return shard, mixer + (0 if moe else ffn)


def op_sac_split(
    a: ModelArgs, layer: int, p: int, tp: int = 1, ep: int = 1, every_other: bool = False
) -> tuple[float, float]:
    """Per token under op-level selective AC (trainer/parallel/parallelize.py keeps every mm,
    SDPA and grouped-mm output; the delta rule's bmm and solves are recomputed): the block
    input, the projections' outputs (Gated DeltaNet: wq, wk, wv, wz, wa, wb, wo; gated
    attention: wq with its gate, wk, wv, wo, SDPA's output and logsumexp) and the
    feed-forward's as trainer.plan.activations.op_sac_split counts them; `every_other` keeps
    half of the projections. Not traced: an estimate."""
    h = a.hybrid
    if h.layer_type(layer) != "full_attention":
        mm = (2 * h.keys + 2 * h.values + 2 * h.linear_v_heads) // tp + a.dim
        sdpa = 0
    else:
        q, kv = a.n_heads * a.head_dim // tp, a.n_kv_heads * a.head_dim // tp
        mm = 2 * q + 2 * kv + a.dim
        sdpa = p * q + FP32 * a.n_heads // tp
    mm = mm // 2 if every_other else mm
    moe = a.is_moe_layer(layer)
    if moe:
        m = a.moe
        routed = (
            p * m.top_k * (2 * m.hidden_dim + a.dim)
            + FP32 * m.n_experts
            + (2 * p * m.top_k * a.dim if ep > 1 else 0)
        )
        ffn = routed + p * (3 * h.shared_expert_hidden + a.dim + 1)
    else:
        ffn = p * (2 * a.hidden_dim // tp + a.dim)
    shard = p * a.dim * (3 if tp > 1 else 1) + (ffn if moe else 0)
    return shard, p * mm + sdpa + (0 if moe else ffn)


def blocks_activations(
    a: ModelArgs,
    p: int,
    tokens: int,
    mode: str,
    option: str,
    every_other: bool,
    tp: int = 1,
    ep: int = 1,
    documents: bool = False,
    seq: int | None = None,
) -> int:
    """Saved activations of all hybrid blocks for one microbatch of `tokens` (whole sequence;
    1/tp of it per rank for the shard terms) under AC `mode` ("none", "full", "selective"
    with `option` "op" or k: blocks with index % k == 0 checkpointed). A checkpointed block
    keeps its input (p x dim on the sequence shard). `seq`: one sequence's tokens on this
    rank (the chunk count), default `tokens`."""
    shard_tokens = -(-tokens // tp)
    seq = seq or tokens
    total = 0.0
    for i in range(a.n_layers):
        if mode == "full" or (mode == "selective" and option != "op" and i % int(option) == 0):
            total += p * a.dim * shard_tokens
            continue
        if mode == "selective" and option == "op":
            shard, whole = op_sac_split(a, i, p, tp, ep, every_other)
        else:
            shard, whole = block_split(a, i, p, seq, tp, ep, documents)
        total += shard * shard_tokens + whole * tokens
    return int(total)


def largest_block(
    a: ModelArgs,
    p: int,
    tokens: int,
    tp: int = 1,
    ep: int = 1,
    documents: bool = False,
    seq: int | None = None,
) -> int:
    """Bytes of the largest block's saved activations (the one recomputed under AC)."""
    shard_tokens = -(-tokens // tp)
    return int(
        max(
            sh * shard_tokens + wh * tokens
            for sh, wh in (
                block_split(a, i, p, seq or tokens, tp, ep, documents) for i in range(a.n_layers)
            )
        )
    )
