"""DeepSeek-V3's architecture as flavors (`model.flavor`): DeepSeek-V3 itself, Kimi K2 and
Moonlight's shape, and a CPU-sized debug model. Without torch, like the rest of the family's
config side."""

from __future__ import annotations

from trainer.models.args import ModelArgs, MoEArgs
from trainer.models.common.rope import DEEPSEEK_V3_YARN, KIMI_K2_YARN
from trainer.models.deepseek_v3.args import MLAArgs

FLAVORS: dict[str, ModelArgs] = {
    # DeepSeek-V3's architecture (MLA, group-limited sigmoid routing with a shared expert,
    # the first blocks dense) at a CPU size: 4 blocks (the first dense), 8 experts of width
    # 96 in 2 groups (top 2 of 1 group), small latent ranks. With model.mtp_layers = 1 it is
    # configs/debug_dsv3.toml.
    "debugmodel-dsv3": ModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=8192,
        norm_eps=1e-6,
        rope_theta=10000.0,
        explicit_hidden_dim=192,
        mla=MLAArgs(
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
        ),
        moe=MoEArgs(
            n_experts=8,
            top_k=2,
            hidden_dim=96,
            n_shared_experts=1,
            score_func="sigmoid",
            first_dense_layers=1,
            route_scale=2.5,
            n_group=2,
            topk_group=1,
        ),
    ),
    # Moonlight-16B-A3B's shape (DeepSeek-V3 architecture, no query latent): 27 blocks, 64
    # experts + 2 shared, top 6, 16B total, 3B active.
    "deepseek-v3-16b": ModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=163840,
        norm_eps=1e-5,
        rope_theta=50000.0,
        explicit_hidden_dim=11264,
        mla=MLAArgs(
            q_lora_rank=0,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoEArgs(
            n_experts=64,
            top_k=6,
            hidden_dim=1408,
            n_shared_experts=2,
            score_func="sigmoid",
            first_dense_layers=1,
            route_scale=2.446,
        ),
    ),
    # DeepSeek-V3 (671B, 37B active): 61 blocks (the first 3 dense), 256 experts in 8 groups
    # (top 8 of 4 groups) + 1 shared, MLA with q_lora_rank 1536, kv_lora_rank 512; YaRN RoPE
    # as released (factor 40 over 4,096 positions), so the released weights load exactly.
    "deepseek-v3-671b": ModelArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        vocab_size=129280,
        norm_eps=1e-6,
        rope_theta=10000.0,
        explicit_hidden_dim=18432,
        rope_scaling=DEEPSEEK_V3_YARN,
        mla=MLAArgs(
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoEArgs(
            n_experts=256,
            top_k=8,
            hidden_dim=2048,
            n_shared_experts=1,
            score_func="sigmoid",
            first_dense_layers=3,
            route_scale=2.5,
            n_group=8,
            topk_group=4,
        ),
    ),
    # Kimi K2 (1.04T, 32B active): DeepSeek-V3's blocks with 384 experts, 64 heads, the first
    # block dense, no expert groups; YaRN RoPE as released (factor 32).
    "kimi-k2": ModelArgs(
        dim=7168,
        n_layers=61,
        n_heads=64,
        n_kv_heads=64,
        vocab_size=163840,
        norm_eps=1e-6,
        rope_theta=50000.0,
        explicit_hidden_dim=18432,
        rope_scaling=KIMI_K2_YARN,
        mla=MLAArgs(
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoEArgs(
            n_experts=384,
            top_k=8,
            hidden_dim=2048,
            n_shared_experts=1,
            score_func="sigmoid",
            first_dense_layers=1,
            route_scale=2.827,
        ),
    ),
}
