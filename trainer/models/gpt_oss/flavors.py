"""gpt-oss's flavors (`model.flavor`): the two releases' shapes and a CPU-sized debug model.
Without torch, like the rest of the family's config side."""

from __future__ import annotations

from trainer.models.args import ModelArgs, MoEArgs
from trainer.models.common.rope import YarnScaling
from trainer.models.gpt_oss.args import GptOssLayers

# As released (config.json of openai/gpt-oss-20b and -120b, tests/data/releases/): YaRN 32
# over 4,096 positions with the ramp's ends not rounded (truncate: false), no mscale keys:
# cos and sin x (0.1 ln 32 + 1), the logits unscaled.
GPT_OSS_YARN = YarnScaling(
    factor=32.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.0,
    mscale_all_dim=0.0,
    truncate=False,
)


def _release(n_layers: int, n_experts: int) -> ModelArgs:
    """gpt-oss-20b (24 layers, 32 experts) and -120b (36, 128): every other shape is shared."""
    return ModelArgs(
        dim=2880,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        explicit_head_dim=64,
        vocab_size=201088,
        norm_eps=1e-5,
        rope_theta=150000.0,
        max_seq_len=131072,
        rope_scaling=GPT_OSS_YARN,
        moe=MoEArgs(n_experts=n_experts, top_k=4, hidden_dim=2880),
        hybrid=GptOssLayers(sliding_window=128),
    )


FLAVORS: dict[str, ModelArgs] = {
    # The releases' architecture at a CPU size: 4 layers (sliding, full, sliding, full) with
    # a window of 16, 8 experts of width 96 (top 2), 4 query and 2 key/value heads of 16.
    # configs/debug_gpt_oss.toml.
    "debugmodel-gpt-oss": ModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        explicit_head_dim=16,
        vocab_size=8192,
        norm_eps=1e-5,
        rope_theta=150000.0,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=96),
        hybrid=GptOssLayers(sliding_window=16),
    ),
    "gpt-oss-20b": _release(24, 32),
    "gpt-oss-120b": _release(36, 128),
}
