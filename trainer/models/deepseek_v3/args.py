"""DeepSeek-V3's part of the model's shape: multi-head latent attention (`ModelArgs.mla`,
through models/args.py's LatentAttention protocol). Without torch, like the family's flavors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class MLAArgs:
    """Multi-head latent attention (DeepSeek-V2/V3, trainer/models/common/mla.py): queries through a
    low-rank path (or one projection with q_lora_rank 0), keys and values from one compressed
    latent per token plus a RoPE key shared by every head."""

    family: ClassVar[str] = "deepseek_v3"

    q_lora_rank: int = 0  # 0: a plain query projection (DeepSeek-V2-Lite, Moonlight)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128  # the query/key channels without rotation
    qk_rope_head_dim: int = 64  # the rotated channels (the key's are shared by all heads)
    v_head_dim: int = 128

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, dim: int, n_heads: int) -> int:
        q = (
            (
                dim * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * n_heads * self.qk_head_dim
            )
            if self.q_lora_rank
            else dim * n_heads * self.qk_head_dim
        )
        kv = (
            dim * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return q + kv + n_heads * self.v_head_dim * dim

    def validate(self) -> None:
        from trainer.errors import ConfigError

        dims = (
            self.q_lora_rank,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        if min(dims) < 0 or min(dims[1:]) < 1 or self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model MLA dims do not add up: q_lora_rank {self.q_lora_rank} "
                f"(>= 0), kv_lora_rank {self.kv_lora_rank}, qk_nope_head_dim "
                f"{self.qk_nope_head_dim}, v_head_dim {self.v_head_dim} (>= 1) "
                f"and qk_rope_head_dim {self.qk_rope_head_dim} (even, >= 2)"
            )
