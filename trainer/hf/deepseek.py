"""DeepSeek-V3 (and Kimi K2, Moonlight) between this trainer and Hugging Face's
DeepseekV3ForCausalLM: the names of MLA's projections, the shared experts and the router's
score-correction bias, and config.json.

The layout needs no permutation: DeepSeek released its weights with the RoPE channels in
consecutive pairs (`rope_interleave = true`, transformers' default), the pairs
trainer/models/layers.py rotates. A folder with `rope_interleave = false` (rotate-half
layout) or RoPE scaled otherwise than by YaRN (what DeepSeek-V3 and Kimi K2 are released
with: trainer/models/layers.py) is refused in one line rather than loaded into different logits.
The balancing bias of training (`moe.load_balance_coeff`) is DeepSeek-V3's
`e_score_correction_bias`: it is exported and imported, so routing is the same on both sides.
Multi-token prediction modules are not part of DeepseekV3ForCausalLM (transformers does not
run them): exports leave them out, imports leave them at their seeded init, each with a line.
"""

from __future__ import annotations

from trainer.models.args import ModelArgs

MLA_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
MTP_NOTE = ("the {n} multi-token prediction module(s) (model.mtp_layers) are not part of "
            "DeepseekV3ForCausalLM, which does not run them: {what}")


def mla_shapes(args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    """(name under `layers.i.`, shape) of one block's MLA parameters, in model order."""
    m, d, h = args.mla, args.dim, args.n_heads
    q = [("attention.wq_a.weight", (m.q_lora_rank, d)),
         ("attention.q_a_norm.weight", (m.q_lora_rank,)),
         ("attention.wq_b.weight", (h * m.qk_head_dim, m.q_lora_rank))] if m.q_lora_rank \
        else [("attention.wq.weight", (h * m.qk_head_dim, d))]
    return q + [("attention.wkv_a.weight", (m.kv_lora_rank + m.qk_rope_head_dim, d)),
                ("attention.kv_a_norm.weight", (m.kv_lora_rank,)),
                ("attention.wkv_b.weight", (h * (m.qk_nope_head_dim + m.v_head_dim),
                                            m.kv_lora_rank)),
                ("attention.wo.weight", (d, h * m.v_head_dim))]


def shared_expert_shapes(args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    width = args.moe.hidden_dim * args.moe.n_shared_experts
    if not width:
        return []
    return [("feed_forward.shared_experts.w1.weight", (width, args.dim)),
            ("feed_forward.shared_experts.w2.weight", (args.dim, width)),
            ("feed_forward.shared_experts.w3.weight", (width, args.dim))]


def deepseek_config(args: ModelArgs) -> dict:
    """The DeepseekV3ForCausalLM part of config.json."""
    m, moe = args.mla, args.moe
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
           "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
           "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
           "rope_interleave": True, "num_nextn_predict_layers": 0}
    if moe is None:  # dense: every block's FFN is the dense one
        return {**cfg, "first_k_dense_replace": args.n_layers, "n_routed_experts": 1,
                "num_experts_per_tok": 1, "n_shared_experts": 0, "moe_intermediate_size": 1,
                "n_group": 1, "topk_group": 1}
    return {**cfg, "n_routed_experts": moe.n_experts, "num_experts_per_tok": moe.top_k,
            "n_shared_experts": moe.n_shared_experts, "moe_intermediate_size": moe.hidden_dim,
            "first_k_dense_replace": moe.first_dense_layers, "n_group": moe.n_group,
            "topk_group": moe.topk_group, "routed_scaling_factor": moe.route_scale,
            "norm_topk_prob": moe.norm_topk_prob, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc"}


def yarn_ratio(s: dict, cfg: dict) -> float | None:
    """max_position_embeddings / original_max_position_embeddings, which transformers 4.x
    takes as YaRN's factor whenever the original is given (5.x only where factor is not)."""
    original, longest = s.get("original_max_position_embeddings"), \
        cfg.get("max_position_embeddings")
    return longest / original if original and longest else None


def unsupported(cfg: dict) -> str | None:
    """Why a deepseek_v3 config.json cannot be loaded exactly here, or None."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        return (f"its RoPE is {kind!r}-scaled, which this trainer does not implement for MLA "
                "(plain RoPE and YaRN, as DeepSeek-V3 and Kimi K2 are released)")
    ratio = yarn_ratio(rope, cfg) if kind == "yarn" else None
    original = rope.get("original_max_position_embeddings") or 1
    if ratio and rope.get("factor") and abs(ratio - float(rope["factor"])) * original > 0.5:
        return (f"its YaRN factor {rope['factor']} is not max_position_embeddings / "
                f"original_max_position_embeddings = {ratio:g}, which transformers 4.x takes "
                "as the factor instead (5.x takes `factor`): the two would build different "
                "models")
    if kind == "yarn" and rope.get("attention_factor") is not None:
        return ("its YaRN sets attention_factor, which DeepSeek's releases do not (they set "
                "mscale and mscale_all_dim); this trainer derives the factor from those")
    if cfg.get("rope_interleave", True) is False:
        return ("rope_interleave = false (rotate-half RoPE layout); DeepSeek's released "
                "weights and this trainer's use interleaved pairs")
    return None


def compare(cfg: dict, args: ModelArgs) -> tuple[dict, dict]:
    """(theirs, ours) for the settings that change a DeepSeek-V3 model without changing a
    tensor shape."""
    moe = args.moe
    theirs = {"first_k_dense_replace": int(cfg.get("first_k_dense_replace") or 0),
              "n_group": int(cfg.get("n_group") or 1), "topk_group": int(cfg.get("topk_group") or 1),
              "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
              "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
              "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0)}
    if moe is None:
        return {"first_k_dense_replace": theirs["first_k_dense_replace"]}, \
            {"first_k_dense_replace": args.n_layers}
    ours = {"first_k_dense_replace": moe.first_dense_layers, "n_group": moe.n_group,
            "topk_group": moe.topk_group, "routed_scaling_factor": float(moe.route_scale),
            "norm_topk_prob": moe.norm_topk_prob, "num_experts_per_tok": moe.top_k}
    return theirs, ours
