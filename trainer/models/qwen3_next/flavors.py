"""Qwen3-Next's and Qwen3.5's flavors (`model.flavor`): the releases' shapes and a CPU-sized
debug model. Without torch, like the rest of the family's config side."""

from __future__ import annotations

from trainer.models.args import ModelArgs, MoEArgs
from trainer.models.qwen3_next.args import HybridArgs

FLAVORS: dict[str, ModelArgs] = {
    # Qwen3-Next's hybrid (model.py, docs/qwen3_next.md) at a CPU size:
    # Gated DeltaNet, gated attention, DeltaNet, gated attention; every layer MoE (8 experts
    # of width 96, top 2) with a gated shared expert. configs/debug_qwen3_next.toml.
    "debugmodel-qwen3-next": ModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        explicit_head_dim=16,
        vocab_size=8192,
        norm_eps=1e-6,
        qk_norm=True,
        explicit_hidden_dim=192,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=96),
        hybrid=HybridArgs(
            full_attention_interval=2,
            linear_k_heads=2,
            linear_v_heads=4,
            linear_k_head_dim=16,
            linear_v_head_dim=16,
            shared_expert_hidden=96,
        ),
    ),
    # Qwen3-Next-80B-A3B's and Qwen3.5-35B-A3B's shapes: transformers 5.24's Qwen3NextConfig /
    # Qwen3_5MoeTextConfig defaults (the releases' shapes); RoPE theta 1e7 as their config.json
    # (transformers' default: 1e4). 48 (40) layers, 3 DeltaNet to 1 gated attention; 512 (256)
    # experts of width 512, top 10 (8), plus the gated shared expert. The dense width (5,120 in
    # the 80B's config.json) is unused: every layer is MoE.
    "qwen3-next-80b-a3b": ModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=16,
        n_kv_heads=2,
        explicit_head_dim=256,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1e7,
        qk_norm=True,
        explicit_hidden_dim=5120,
        moe=MoEArgs(n_experts=512, top_k=10, hidden_dim=512),
        hybrid=HybridArgs(shared_expert_hidden=512),
    ),
    "qwen3.5-35b-a3b": ModelArgs(
        dim=2048,
        n_layers=40,
        n_heads=16,
        n_kv_heads=2,
        explicit_head_dim=256,
        vocab_size=248320,
        norm_eps=1e-6,
        rope_theta=1e7,
        qk_norm=True,
        explicit_hidden_dim=512,
        moe=MoEArgs(n_experts=256, top_k=8, hidden_dim=512),
        hybrid=HybridArgs(shared_expert_hidden=512),
    ),
}
