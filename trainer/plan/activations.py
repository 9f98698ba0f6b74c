"""Saved activations and the loss region per microbatch, for the memory plan
(trainer/plan/memory.py): what one block, the head and the loss keep for backward, per token,
without and with tensor parallelism (sequence parallel: norms on 1/tp of the sequence, attention and
FFN on 1/tp of the heads and width; loss parallel: 1/tp of the vocab).
"""

from __future__ import annotations

import math

from trainer.config.job import JobConfig
from trainer.models import registry
from trainer.models.args import ModelArgs
from trainer.plan.moe import moe_ffn_bytes, moe_layers

FP32 = 4


# --------------------------------------------------------------------------- activations


def block_split(
    a: ModelArgs, p: int, tp: int = 1, moe: bool = False, ep: int = 1
) -> tuple[int, int]:
    """Bytes one block saves for backward, no AC (eager trainer.models.common.decoder), as (per
    token of this
    rank's sequence shard, per token of the whole microbatch); their sum per token is the
    block's figure without TP.

    RMSNorm x2: the fp32 upcast and the normed output in the compute dtype, (4 + p) * dim each
    (in fp32 the upcast is the input itself: still 8 * dim). Attention: the normed input of
    wq/wk/wv (p * dim); SDPA's q and output (wo's input is a view of it) at p * n_heads *
    head_dim each, k and v at p * n_kv_heads * head_dim each (GQA in the kernel, `enable_gqa`,
    as FlexAttention does: no repeated copies; per-document SDPA keeps each document's output
    and wo's input, their concatenation: one more p * n_heads * head_dim);
    the logsumexp, fp32 per head.
    RoPE saves only the cos/sin tables. FFN: the normed input (p * dim) and four hidden-sized
    tensors (w1 and w3 outputs, silu output, their product: w2's input).
    `moe`: a MoE block, whose feed-forward saves `trainer.plan.moe.moe_ffn_bytes` instead.
    With tp > 1 (sequence parallel): the norms see 1/tp of the sequence (the first figure);
    the inputs of wq/wk/wv and w1/w3 are the all-gathered whole sequence (p * dim each); the
    heads and the FFN width are split, so everything attention and FFN save is 1/tp.
    """
    q, kv = a.n_heads * a.head_dim // tp, a.n_kv_heads * a.head_dim // tp
    kernel = a.attn_implementation if a.attn_mask_type == "block_causal" else "sdpa"
    attn = registry.hooks(a).plan_attention_saved(a, p, tp, kernel)  # a family's own
    if attn is None:
        attn = 2 * p * (q + kv) + (p * q if kernel == "per_document" else 0)
    if moe:  # the MoE feed-forward runs on this rank's sequence shard (trainer/parallel/tp.py)
        return 2 * (4 + p) * a.dim + moe_ffn_bytes(
            a, p, ep
        ), 2 * p * a.dim + attn + FP32 * a.n_heads // tp
    inner = 2 * p * a.dim + attn + FP32 * a.n_heads // tp + 4 * p * a.hidden_dim // tp
    return 2 * (4 + p) * a.dim, inner


def block_saved(a: ModelArgs, p: int) -> int:
    """Bytes one block saves for backward per token without TP, no AC (see `block_split`)."""
    return sum(block_split(a, p))


def op_sac_split(
    a: ModelArgs, p: int, tp: int = 1, every_other: bool = False, moe: bool = False, ep: int = 1
) -> tuple[int, int]:
    """Per token under op-level selective AC (trainer.parallel.parallelize keeps every mm, SDPA
    and TP reduce-scatter output): the block input, the outputs of wq, wk, wv, wo, w1, w3, w2
    (`every_other`: of wq, wv, w1 and w2 only) and SDPA's output and logsumexp. Everything else
    is recomputed in backward. As (sequence-shard, whole-sequence) bytes like `block_split`:
    with tp > 1 the block input and the two reduce-scatter outputs are sequence-sharded, the
    outputs of the colwise matmuls and SDPA are 1/tp, and wo's and w2's are their full
    [tokens, dim] partial sums (before the reduce-scatter)."""
    q, kv = a.n_heads * a.head_dim // tp, a.n_kv_heads * a.head_dim // tp
    h = a.hidden_dim // tp
    mm_out = q + kv + h + a.dim if every_other else q + 2 * kv + a.dim + 2 * h + a.dim
    own = registry.hooks(a).plan_attention_kept(a, tp, every_other)
    if own is not None:  # a family's attention matmuls in place of wq, wk, wv
        mm_out += own[0] - (q + kv if every_other else q + 2 * kv)
        q = own[1]  # SDPA's output
    shard = p * a.dim * (3 if tp > 1 else 1)
    extra = 0
    if moe:  # the experts' grouped GEMMs, the router's matmul and the all-to-alls are kept
        m = a.moe
        mm_out -= h + (0 if every_other else h + a.dim)
        extra = (
            p * m.top_k * (2 * m.hidden_dim + a.dim)
            + FP32 * m.n_experts
            + (2 * p * m.top_k * a.dim if ep > 1 else 0)
            + p * m.n_shared_experts * (2 * m.hidden_dim + a.dim)
        )
    # a MoE feed-forward's kept outputs are its sequence shard's (trainer/parallel/tp.py)
    return shard + extra, p * mm_out + p * q + FP32 * a.n_heads // tp


def block_saved_op_sac(a: ModelArgs, p: int) -> int:
    """Per token under op-level selective AC without TP (see `op_sac_split`)."""
    return sum(op_sac_split(a, p))


def sp_tokens(tokens: int, tp: int) -> int:
    """Tokens of one rank's sequence shard under sequence parallelism (rank 0: ceil)."""
    return -(-tokens // tp)


def split_bytes(split: tuple[int, int], tokens: int, tp: int) -> int:
    """Bytes of a (sequence-shard, whole-sequence) per-token pair for one microbatch."""
    return split[0] * sp_tokens(tokens, tp) + split[1] * tokens


def checkpointed_blocks(cfg: JobConfig, n_layers: int) -> int:
    """Blocks recomputed in full: all (full), those with index % k == 0 (selective k), none."""
    ac = cfg.activation_checkpoint
    if ac.mode == "full":
        return n_layers
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        return math.ceil(n_layers / int(ac.selective_ac_option))
    return 0


def blocks_activations(
    cfg: JobConfig,
    a: ModelArgs,
    p: int,
    tokens: int,
    mode: str | None = None,
    tp: int = 1,
    ep: int = 1,
) -> int:
    """Saved activations of all blocks for one microbatch under an AC mode (default: config's).
    A checkpointed block keeps only its input (p * dim per token; 1/tp of the sequence under
    TP). With document positions and p < 4, FSDP casts the per-token fp32 cos/sin to the
    compute dtype at every block's input, and each block keeps its copy in every AC mode
    (p * head_dim per token; whole sequence under TP)."""
    mode = mode or cfg.activation_checkpoint.mode
    ac = cfg.activation_checkpoint
    own = registry.hooks(a).plan_blocks_activations(  # a family's own blocks
        a,
        p,
        tokens,
        mode=mode,
        option=ac.selective_ac_option,
        every_other=ac.selective_op_matmuls == "every_other",
        tp=tp,
        ep=ep,
        documents=a.attn_mask_type == "block_causal",
        seq=min(cfg.training.seq_len, tokens),
    )
    if own is not None:
        return own
    rope = a.n_layers * p * a.head_dim * tokens if a.positions == "document" and p < FP32 else 0
    n_moe = min(moe_layers(a), a.n_layers)  # (a pipeline stage's n_layers may be fewer)
    ckpt_input = p * a.dim * sp_tokens(tokens, tp)

    def per_block(split_fn) -> float:  # mean over the dense and MoE blocks
        dense = split_bytes(split_fn(False), tokens, tp)
        if not n_moe:
            return dense
        return dense + n_moe / a.n_layers * (split_bytes(split_fn(True), tokens, tp) - dense)

    full = per_block(lambda moe: block_split(a, p, tp, moe, ep))
    if mode == "none":
        return int(a.n_layers * full) + rope
    if mode == "full":
        return a.n_layers * ckpt_input + rope
    if cfg.activation_checkpoint.selective_ac_option == "op":
        every_other = cfg.activation_checkpoint.selective_op_matmuls == "every_other"
        return (
            int(a.n_layers * per_block(lambda moe: op_sac_split(a, p, tp, every_other, moe, ep)))
            + rope
        )
    ckpt = checkpointed_blocks(cfg, a.n_layers)
    return int(ckpt * ckpt_input + (a.n_layers - ckpt) * full) + rope


def head_saved(a: ModelArgs, p: int) -> int:
    """Per token: the final RMSNorm ((4 + p) * dim) and the output head's input (p * dim)."""
    return (4 + 2 * p) * a.dim


def head_activations(a: ModelArgs, p: int, tokens: int, tp: int = 1) -> int:
    """`head_saved` for one microbatch; under TP the final norm sees 1/tp of the sequence and
    the head's input is the all-gathered whole sequence."""
    return split_bytes(((4 + p) * a.dim, p * a.dim), tokens, tp)


def loss_region(
    cfg: JobConfig, a: ModelArgs, p: int, tokens: int, tp: int = 1, loss_parallel: bool = True
) -> dict[str, int]:
    """What the loss (trainer/models/common/loss.py) holds for one microbatch: `at_loss`, at its
    widest; `at_head`, in the head's backward; `after`, through the rest of the backward.

    eager: the [batch, seq, vocab] logits in the compute dtype are counted as held through the
    whole backward; cross-entropy upcasts them to fp32, its log-softmax saves an fp32 output,
    and its backward holds that output, the incoming and the produced fp32 gradient at once:
    p + 12 bytes per logit at the peak, 2p in the head's backward.
    chunked: dh (p per token and dim) and the fp32 dW ([vocab, dim]) live from the loss's
    forward to the head's backward, which casts dW to the compute dtype (p * vocab * dim more,
    none in fp32). One chunk of c tokens holds its logits in the compute dtype and in fp32,
    then the fp32 softmax and its cast (both (4 + p) * c * vocab in bf16, 4 * c * vocab in
    fp32), then the cast and dW's product in the compute dtype (bf16 only). Nothing is held
    after the head's backward.
    With tp > 1 the loss sees every token of the microbatch (the head's input is gathered):
    under loss parallel each rank's vocab is vocab / tp (logits, chunks and dW all shrink by
    tp); with `disable_loss_parallel` the head's weight is all-gathered over tp (p * vocab *
    dim more, held at the loss and in the head's backward) and the loss is over the full vocab.
    """
    v = a.vocab_size // tp if loss_parallel else a.vocab_size
    gathered_w = p * a.vocab_size * a.dim if tp > 1 and not loss_parallel else 0
    if cfg.training.loss == "eager":
        held = p * v * tokens
        return {
            "at_loss": held + 3 * FP32 * v * tokens + gathered_w,
            "at_head": 2 * held + gathered_w,
            "after": held,
        }
    c = min(cfg.training.loss_chunk_size, tokens)
    grads = p * tokens * a.dim + FP32 * v * a.dim
    cast = p * v * a.dim if p < FP32 else 0
    chunk = max((FP32 + p) * c * v, p * c * v + cast) if p < FP32 else FP32 * c * v
    return {"at_loss": grads + chunk + gathered_w, "at_head": grads + cast + gathered_w, "after": 0}


def cp_attention_bytes(
    a: ModelArgs, cfg: JobConfig, p: int, batch: int, seq: int, cp: int, tp: int = 1
) -> tuple[int, int]:
    """Context parallelism's attention inputs for one microbatch on one cp rank, as
    (once per microbatch, per layer saved): the mask over [seq / cp queries, seq keys]
    (FlexAttention's block tables, ~16 bytes per 128 x 128 tile, as the plan assumes CUDA)
    and the document RoPE tables of the local tokens; and each layer's all-gathered K and V
    of the whole sequence (1/tp of the KV heads), which attention saves for its backward."""
    local = seq // cp
    once = 16 * batch * -(-local // 128) * -(-seq // 128)
    if a.positions == "document":
        once += 4 * a.head_dim * batch * local
    kv = registry.hooks(a).plan_cp_attention(a, p, batch, seq, tp)  # a family's own
    if kv is None:
        kv = 2 * p * batch * seq * max(a.n_kv_heads // tp, 1) * a.head_dim
    return once, kv


def cp_saved_layers(cfg: JobConfig, n_layers: int) -> int:
    """Layers whose gathered K/V stay saved until backward under the configured AC mode."""
    mode = cfg.activation_checkpoint.mode
    if mode == "none" or (
        mode == "selective" and cfg.activation_checkpoint.selective_ac_option == "op"
    ):
        return n_layers
    if mode == "full":
        return 0
    return n_layers - checkpointed_blocks(cfg, n_layers)
