"""gpt-oss's blocks in the memory plan (trainer/plan/activations.py's formulas, with what its
layers keep beyond the decoder's), per token in the compute dtype p:

- **Attention with sinks**: the decoder's (q, k, v, the output, the fp32 log-sum-exp per head)
  and the sinks' weight sigmoid(lse - sink), fp32 per head. On CUDA FlexAttention keeps K and
  V at the key heads; the CPU kernel repeats them to the query heads (not booked: the plan is
  for GPUs).
- **Experts** (in place of trainer/plan/moe.py's SwiGLU experts): for each of the top_k routed
  copies its input, the clamped SwiGLU's two inputs (model.py: `ClampedSwiGLU` saves only
  those), the down projection's input, its output and the weighted output, the row's expert
  index (int64); the router's fp32 logits and probabilities. Under ep the rows a rank
  receives are the experts' input, counted once (the traced dry run of configs/
  gpt_oss_120b.toml keeps nothing else of the all-to-all).

Measured against the tensors autograd saves for one block (tests/test_gpt_oss.py): within 4%
(the plan slightly under), in fp32 at the debug shape and in bf16 at the 120b widths.
"""

from __future__ import annotations

from trainer.models.args import ModelArgs

FP32, INT64 = 4, 8


def experts_bytes(a: ModelArgs, p: int, ep: int) -> int:
    """Per token, what a gpt-oss MoE saves (see the module docstring)."""
    m = a.moe
    row = p * a.dim + 3 * p * m.hidden_dim + 2 * p * a.dim + INT64
    return 2 * FP32 * m.n_experts + m.top_k * row


def block_split(a: ModelArgs, p: int, tp: int, ep: int) -> tuple[int, int]:
    """Per token without AC, as (sequence shard, whole sequence): the decoder's MoE block with
    gpt-oss's experts and the sinks' weights."""
    from trainer.plan.activations import block_split as decoder_split
    from trainer.plan.moe import moe_ffn_bytes

    shard, whole = decoder_split(a, p, tp, True, ep)
    shard += experts_bytes(a, p, ep) - moe_ffn_bytes(a, p, ep)
    return shard, whole + FP32 * a.n_heads // tp


def blocks_activations(
    a, p, tokens, mode, option, every_other, tp=1, ep=1, documents=False, seq=None
) -> int:
    """Saved activations of all blocks for one microbatch of `tokens` under AC `mode`, as
    trainer/plan/activations.py's `blocks_activations` counts the decoder's."""
    from trainer.plan.activations import op_sac_split, sp_tokens

    shard_tokens = sp_tokens(tokens, tp)
    if mode == "full":
        return a.n_layers * p * a.dim * shard_tokens
    if mode == "selective" and option == "op":
        shard, whole = op_sac_split(a, p, tp, every_other, True, ep)
        return int(a.n_layers * (shard * shard_tokens + whole * tokens))
    shard, whole = block_split(a, p, tp, ep)
    saved = shard * shard_tokens + whole * tokens
    kept = a.n_layers if mode == "none" else a.n_layers - -(-a.n_layers // int(option))
    return int(kept * saved + (a.n_layers - kept) * p * a.dim * shard_tokens)


def largest_block(a, p, tokens, tp=1, ep=1, documents=False, seq=None) -> int:
    """Bytes of one block's saved activations (every block saves alike)."""
    from trainer.plan.activations import sp_tokens

    shard, whole = block_split(a, p, tp, ep)
    return int(shard * sp_tokens(tokens, tp) + whole * tokens)
