"""What multi-head latent attention saves and gathers (trainer/models/common/mla.py), for the
memory plan (trainer/plan/activations.py) and the traffic plan (trainer/plan/comm.py): the
terms that replace GQA's in the shared formulas. Bytes per token at `p` bytes per value."""

from __future__ import annotations

FP32 = 4


def mla_saved(a, p: int, tp: int, kernel: str) -> int:
    """Bytes MLA's attention saves per token, no AC: the two latent RMSNorms' fp32 upcast and
    output (replicated over tp), SDPA's q, k and output, and v as a view of wkv_b's output
    (its key half with it); per_document also keeps the output's concatenation."""
    m, heads = a.mla, a.n_heads // tp
    latents = (FP32 + p) * (m.q_lora_rank + m.kv_lora_rank) + p * m.qk_rope_head_dim
    sdpa = p * heads * (2 * m.qk_head_dim + m.qk_nope_head_dim + 2 * m.v_head_dim)
    return latents + sdpa + (p * heads * m.v_head_dim if kernel == "per_document" else 0)


def mla_kept(a, tp: int, every_other: bool) -> tuple[int, int]:
    """Under op-level selective AC: the values per token of wq_a, wq_b (or wq), wkv_a and
    wkv_b's outputs that AC keeps (`every_other`: half of them), and SDPA's output width."""
    m = a.mla
    outputs = (
        m.q_lora_rank
        + m.kv_lora_rank
        + m.qk_rope_head_dim
        + a.n_heads * (m.qk_head_dim + m.qk_nope_head_dim + m.v_head_dim) // tp
    )
    return (outputs // 2 if every_other else outputs), a.n_heads * m.v_head_dim // tp


def mla_cp_saved(a, p: int, batch: int, seq: int, tp: int) -> int:
    """Bytes one layer saves of the whole sequence under context parallelism: the gathered
    latents, and the whole sequence's K and V built from them."""
    m = a.mla
    per_token = (
        m.kv_lora_rank
        + m.qk_rope_head_dim
        + a.n_heads // tp * (m.qk_head_dim + m.qk_nope_head_dim + m.v_head_dim)
    )
    return p * batch * seq * per_token
